"""The real speculators library reads selfspec's export and writes what selfspec imports: draft
logits agree to float32 rounding (scripts/interop_speculators.sh; its check is
scripts/interop_speculators_check.py). Skipped unless .venv-interop was set up by that script,
so no test reaches the network."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "interop_speculators.sh"
READY = ROOT / ".venv-interop" / "selfspec-interop-pins.txt"  # written when setup completed


@pytest.mark.interop
@pytest.mark.skipif(not READY.is_file(), reason="no .venv-interop: run " + str(SCRIPT))
def test_real_speculators_agrees_with_selfspec(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    done = subprocess.run(
        ["bash", str(SCRIPT), "--json", str(results)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads(results.read_text())
    assert summary["ok"] and summary["worst"] <= 1e-4
    assert summary["versions"]["speculators"] == "0.9.0"
    assert set(summary["results"]) == {
        "export_whole_vocab",
        "export_draft_vocab",
        "export_draft_vocab_no_embedding",
        "import_from_speculators",
    }
