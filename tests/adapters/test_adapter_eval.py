"""`selfspec eval`: a robustness report for the base and every adapter, and its gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import make_lively_model, save_tiny_target

from selfspec import build_heads, heads_config_for, save_heads
from selfspec.cli import main
from selfspec.fingerprint import fingerprint_of


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("eval")
    target = save_tiny_target(root / "tiny-llama")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)
    heads = save_heads(
        build_heads(heads_config_for(model, "medusa")), root / "heads", fingerprint_of(model)
    )
    prompts = root / "prompts.jsonl"
    lines = [{"prompt": "hello"}, {"messages": [{"role": "user", "content": "hi there"}]}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return target, heads, prompts


def _eval(setup, adapter_root: Path, out: Path, *extra: str) -> int:
    target, heads, prompts = setup
    return main([
        "eval", "--model", str(target), "--heads", str(heads), "--adapters-root",
        str(adapter_root), "--prompts", str(prompts), "--max-new-tokens", "8",
        "--out", str(out), *extra,
    ])


def test_eval_writes_json_markdown_and_plot(setup, adapter_root, tmp_path, capsys) -> None:
    assert _eval(setup, adapter_root, tmp_path, "--min-ratio", "0.01") == 0
    report = json.loads((tmp_path / "robustness.json").read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == ["(base)", "all.linear", "attn", "mlp_down"]
    for row in rows.values():
        assert row["lossless"] and row["greedy_equal"] == row["prompts"] == 2
        assert row["tau"] >= 1.0 and row["vanilla_tps"] > 0 and row["speculative_tps"] > 0
        assert all(0.0 <= rate <= 1.0 for rate in row["acceptance_by_depth"])
    assert rows["(base)"]["tau_ratio"] == 1.0
    assert rows["(base)"]["agreement_with_base"] == 1.0
    for name in ("all.linear", "attn", "mlp_down"):  # measured for every adapter
        assert 0.0 <= rows[name]["agreement_with_base"] <= 1.0
    assert min(rows[n]["agreement_with_base"] for n in ("all.linear", "attn", "mlp_down")) < 1.0
    markdown = (tmp_path / "robustness.md").read_text()
    assert "| all.linear |" in markdown and "speedup" in markdown
    assert (tmp_path / "robustness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| mlp_down |" in capsys.readouterr().out


def test_eval_gate_fails_and_lists_adapters_below(setup, adapter_root, tmp_path, capsys) -> None:
    code = _eval(setup, adapter_root, tmp_path, "--min-ratio", "1000", "--no-plot",
                 "--adapters", "attn", "mlp_down")
    assert code == 1
    err = capsys.readouterr().err
    assert "below --min-ratio 1000.0: attn (" in err and "mlp_down (" in err
    assert "all.linear" not in err
    assert not (tmp_path / "robustness.png").exists()


def test_eval_bad_prompts_file_is_a_clear_error(setup, adapter_root, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    target, heads, _ = setup
    code = main(["eval", "--model", str(target), "--heads", str(heads), "--adapters-root",
                 str(adapter_root), "--prompts", str(bad), "--out", str(tmp_path)])
    assert code == 2
    assert 'bad.jsonl:1: expected {"prompt": "..."}' in capsys.readouterr().err


def test_adapter_carrying_its_own_heads_is_measured_with_them(
    setup, adapter_root, tmp_path
) -> None:
    import shutil

    from transformers import AutoModelForCausalLM

    target, _, _ = setup
    root = tmp_path / "root"
    shutil.copytree(adapter_root / "attn", root / "attn")
    model = AutoModelForCausalLM.from_pretrained(target)
    own = build_heads(heads_config_for(model, "medusa", num_heads=2))
    save_heads(own, root / "attn" / "heads", fingerprint_of(model))
    assert _eval(setup, root, tmp_path / "out", "--no-plot") == 0
    rows = json.loads((tmp_path / "out" / "robustness.json").read_text())["rows"]
    assert [(row["name"], row["heads"]) for row in rows] == [
        ("(base)", "base"),
        ("attn", "base"),
        ("attn", "own"),
    ]
    assert len(rows[2]["acceptance_by_depth"]) <= 2 and all(row["lossless"] for row in rows)


def test_gate_judges_an_adapter_by_the_heads_it_is_served_with() -> None:
    from selfspec.adapters.robustness import Measurement, RobustnessReport, with_ratios

    def row(name: str, heads: str, tau: float) -> Measurement:
        return Measurement(name, heads, 1, 10, tau, (0.5,), 1.0, 1.0, 1)

    rows = with_ratios([
        row("(base)", "base", 2.0),
        row("recalibrated", "base", 1.0),  # drops with the shared heads ...
        row("recalibrated", "own", 1.9),  # ... but is served with its own
        row("plain", "base", 1.2),
    ])
    report = RobustnessReport(rows=rows, settings={})
    assert [(r.name, r.heads) for r in report.below(0.8)] == [("plain", "base")]
    assert [(r.name, r.heads) for r in report.below(0.99)] == [
        ("recalibrated", "own"),
        ("plain", "base"),
    ]


def test_the_base_agrees_with_its_own_greedy_output(setup) -> None:
    import contextlib

    from selfspec.adapters.robustness import base_agreement
    from selfspec.generation import GenerationConfig, SpeculativeGenerator
    from selfspec.target import TargetSpec, load_target

    target = load_target(TargetSpec(model=str(setup[0])))
    generator = SpeculativeGenerator(target.model, None, target.tokenizer)
    prompt = [3, 9, 4, 11]
    output = generator.generate(prompt, GenerationConfig(max_new_tokens=12, speculate=False))
    assert base_agreement(generator, prompt, output.token_ids, contextlib.nullcontext) == 12
    flipped = [(t + 1) % 50 for t in output.token_ids]
    assert base_agreement(generator, prompt, flipped, contextlib.nullcontext) < 12


def test_eval_measures_with_context_drafts_only_when_asked() -> None:
    """`EvalSettings.context_drafts` reaches the speculative runs: on text that repeats itself,
    chains copied from it raise τ over the (untrained) heads alone; outputs stay vanilla."""
    from selfspec.adapters.robustness import EvalSettings, measure
    from selfspec.drafting.context import ContextDrafts
    from selfspec.generation import SpeculativeGenerator
    from selfspec.tree import DynamicTree

    model = make_lively_model("llama")
    generator = SpeculativeGenerator(model, build_heads(heads_config_for(model, "eagle")).eval())
    prompts = [[1, 23, 5, 61, 8, 30]]
    tree = DynamicTree(3, 4, 12)
    heads_only = measure(generator, prompts, EvalSettings(24, tree, context_drafts=None))
    with_context = measure(generator, prompts, EvalSettings(24, tree, ContextDrafts()))
    assert heads_only.greedy_equal == with_context.greedy_equal == 1
    assert with_context.tau > heads_only.tau


def test_eval_records_its_drafting_options(setup, adapter_root, tmp_path) -> None:
    assert _eval(setup, adapter_root, tmp_path, "--no-plot", "--adapters", "attn",
                 "--no-context-drafts") == 0
    settings = json.loads((tmp_path / "robustness.json").read_text())["settings"]
    assert settings["context_drafts"] is False and settings["draft_corpus"] is None
    assert settings["flags"] and settings["cpu"]  # the machine record names the CPU
