"""benchmarks/many_adapters.py on a tiny model: every synthetic adapter registered with its draft
delta, the mixed round's rows equal to each request run alone, the results file complete."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from benchmark_scripts import load_benchmark
from tiny_models import make_tiny_model

from selfspec.heads import build_heads, heads_config_for
from selfspec.heads.delta import DELTA_DIR
from selfspec.tree import DynamicTree


@pytest.fixture(scope="module")
def many_adapters() -> ModuleType:
    return load_benchmark("many_adapters")


def _heads(model: torch.nn.Module) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        heads = build_heads(heads_config_for(model, "eagle"))
        with torch.no_grad():
            for param in heads.parameters():
                param.add_(torch.randn_like(param) * 0.1)
    return heads.eval()


def test_many_adapters_core_on_a_tiny_model(many_adapters: ModuleType, tmp_path: Path) -> None:
    model = make_tiny_model("llama", 0)
    heads = _heads(model)
    settings = many_adapters.Settings(
        many_adapters.Synthesis(num_adapters=12, rank=4, delta_rank=4),
        batch=3,
        max_resident=4,
        switch_repeats=20,
        round_repeats=2,
        warmup=1,
        tree=DynamicTree(top_k=2, depth=3, budget=6),
    )
    prompts = [[1, 5, 9, 13, 2], [1, 7, 3], [1, 40, 41, 42, 43, 44]]
    root = tmp_path / "adapters"
    results = many_adapters.run(
        model, heads, None, "tiny", prompts, root, settings, log=lambda line: None
    )

    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert len(names) == 12 and all((root / n / DELTA_DIR / "delta.json").is_file() for n in names)
    assert results["registered"] == 12 and not results["rejected"]
    memory = results["memory"]
    assert memory["deltas_registered"] == 12 and memory["lora_resident"] == 4
    assert memory["delta_bank_bytes"] == 12 * memory["delta_bytes_per_adapter"] > 0
    assert results["load"]["lora"]["count"] == 12 and results["load"]["delta"]["count"] == 12
    assert set(results["switch"]["by_deltas_registered"]) == {4, 10, 12}
    # Each row of the mixed round drafts with its own delta among twelve and verifies under its
    # own LoRA among three: the same tree and logits as the request alone, its delta merged.
    exactness = results["exactness"]
    assert exactness["rows"] == 3 and exactness["trees_equal"] == 3
    assert exactness["max_logit_diff"] < 1e-4
    assert exactness["min_logit_diff_across_adapters"] > 1e-2  # the adapters do matter
    assert results["mixed_batch"]["tree_sizes"] == [7, 7, 7]

    # A second run reuses the adapters written by the first.
    again = many_adapters.synthesize(model, _heads(model), root, settings.synthesis)
    assert again["reused"] == 1

    results["machine"] = {
        "cpu": "test", "flags": [], "threads": 1, "dtype": "float32", "model": "tiny",
        "command": "pytest",
    }  # fmt: skip
    report = many_adapters.write_report(results, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    for key in ("memory", "load", "switch", "mixed_batch", "exactness", "machine", "settings"):
        assert key in written
    assert written["mixed_batch"]["ratio_round"] > 0
    assert "12 adapters with draft deltas" in report
    assert (tmp_path / "out" / "many_adapters.png").stat().st_size > 0
