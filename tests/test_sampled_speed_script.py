"""benchmarks/sampled_speed.py: prompt choice, per-method runs and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark
from tiny_models import make_lively_model

from selfspec.generation import SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.sampling import SamplingParams
from selfspec.tree import DynamicTree

sampled_speed = load_benchmark("sampled_speed")


def test_prompts_are_the_first_of_each_category(tmp_path: Path) -> None:
    rows = [{"id": f"{c}-{i}", "category": c, "prompt": f"{c} {i}"} for c in "ab" for i in range(3)]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert sampled_speed.read_prompts(path, 2) == [
        ("a-0", "a 0"),
        ("a-1", "a 1"),
        ("b-0", "b 0"),
        ("b-1", "b 1"),
    ]
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        sampled_speed.read_prompts(tmp_path / "empty.jsonl", 2)


@pytest.mark.parametrize("argv", [["--temperature", "0"], ["--per-category", "0"]])
def test_invalid_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        sampled_speed.parse_args(argv)


def test_methods_run_the_same_prompts_and_report_against_plain_decoding() -> None:
    model = make_lively_model("llama")
    heads = build_heads(heads_config_for(model, "eagle")).eval()
    plain = SpeculativeGenerator(model, None)
    speculative = SpeculativeGenerator(model, heads)
    tree = DynamicTree(3, 3, 6)
    methods = [sampled_speed.Method("plain", plain, speculate=False)] + [
        sampled_speed.Method(s.value, speculative, True, tree, s) for s in sampled_speed.SAMPLINGS
    ]
    params = SamplingParams(temperature=1.0)
    for prompt_id, prompt in (("x", [1, 23, 5, 61]), ("y", [7, 8, 9])):
        for method in methods:
            method.run(prompt, params, 12, sampled_speed.prompt_seed(0, prompt_id))
    rows = sampled_speed.summarise(methods)
    assert [r["method"] for r in rows] == ["plain", "top_k", "without_replacement"]
    assert rows[0]["vs_plain"] == 1.0 and rows[0]["tau"] == 1.0
    assert all(r["runs"] == 2 for r in rows)
    assert all(m.tokens == [12, 12] for m in methods)  # EOS ignored: equal work
    assert all(r["tree_tokens"] > 1 for r in rows[1:])
    report = {
        "settings": {"temperature": 1.0, "top_p": 1.0, "prompts": 2, "max_new_tokens": 12},
        "machine": {"threads": 1, "cpu": "cpu", "flags": ["avx2"]},
        "rows": rows,
    }
    table = sampled_speed.markdown(report)
    assert table.count("\n| ") == 4 and "without_replacement" in table
