"""`selfspec adapters`: lists valid adapters and rejected ones with the reason."""

from __future__ import annotations

import json
import shutil

from tiny_models import save_tiny_target

from selfspec.cli import main


def test_adapters_command_lists_valid_and_rejected(tmp_path, adapter_root, capsys) -> None:
    target = save_tiny_target(tmp_path / "tiny")
    root = shutil.copytree(adapter_root, tmp_path / "root")
    (root / "broken").mkdir()
    assert main(["adapters", "--model", str(target), "--adapters-root", str(root)]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [a["name"] for a in listing["adapters"]] == ["all.linear", "attn", "mlp_down"]
    assert "has no adapter_config.json" in listing["rejected"]["broken"]
