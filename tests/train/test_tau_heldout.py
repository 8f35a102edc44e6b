"""benchmarks/tau_heldout.py: τ per held-out category on a tiny model, and the dedup check."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch
from benchmark_scripts import load_benchmark
from tiny_models import make_tiny_model, make_tiny_tokenizer
from train_helpers import PROMPTS

from selfspec.drafting.context import ContextDrafts
from selfspec.heads import build_heads, heads_config_for
from selfspec.tree import DynamicTree

CATEGORIES = ("mt", "translation", "summarization", "qa", "math", "rag")
TREE = DynamicTree(top_k=3, depth=3, budget=9)


@pytest.fixture(scope="module")
def tau_heldout() -> ModuleType:
    return load_benchmark("tau_heldout")


@pytest.fixture(scope="module")
def heldout(tau_heldout: ModuleType) -> list:
    """Two short prompts per category."""
    return [
        tau_heldout.HeldoutPrompt(f"{c}-{i:02d}", c, f"{c} question {i}: say why?")
        for c in CATEGORIES
        for i in (1, 2)
    ]


def _runs(tau_heldout: ModuleType) -> tuple[torch.nn.Module, list]:
    """A tiny Llama with confident logits, random EAGLE heads and 2 random Medusa heads."""
    model = make_tiny_model("llama", seed=0)
    generator = torch.Generator().manual_seed(0)
    runs = []
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(5.0)
        for kind, extra in (("eagle", {}), ("medusa", {"num_heads": 2})):
            heads = build_heads(heads_config_for(model, kind, **extra))
            for param in heads.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
            tree, note = tau_heldout.tree_for_heads(heads, TREE)
            runs.append(tau_heldout.HeadsRun(kind, heads.eval(), tree, note))
    return model, runs


def test_tau_per_category_on_a_tiny_model(tau_heldout: ModuleType, heldout: list) -> None:
    model, runs = _runs(tau_heldout)
    tokenizer = make_tiny_tokenizer()
    rows = tau_heldout.measure(
        model, tokenizer, runs, heldout, [0.0, 1.0], max_new_tokens=8, stop_token_ids=()
    )
    assert [(r["heads"], r["temperature"]) for r in rows] == [
        ("eagle", 0.0),
        ("eagle", 1.0),
        ("medusa", 0.0),
        ("medusa", 1.0),
    ]
    medusa = runs[1]
    assert medusa.tree.depth == 2 and "2 heads" in medusa.note and not runs[0].note
    for row, run in zip(rows, [runs[0], runs[0], runs[1], runs[1]], strict=True):
        depth = run.tree.depth
        assert list(row["categories"]) == list(CATEGORIES)
        for result in row["categories"].values():
            assert result["prompts"] == 2 and result["target_forwards"] > 0
            assert 1.0 <= result["tau"] <= depth + 1
            assert len(result["acceptance_by_depth"]) <= depth
            assert all(0.0 <= rate <= 1.0 for rate in result["acceptance_by_depth"])
        taus = [result["tau"] for result in row["categories"].values()]
        assert row["mean_tau"] == pytest.approx(statistics.mean(taus), abs=1e-4)
        assert row["min_category"]["tau"] == min(taus)
        assert 1.0 <= row["pooled"]["tau"] <= depth + 1
        forwards = sum(r["target_forwards"] for r in row["categories"].values())
        assert row["pooled"]["target_forwards"] == forwards
    # Sampled runs repeat exactly: every prompt has its own fixed seed.
    again = tau_heldout.measure_run(
        tau_heldout.SpeculativeGenerator(model, runs[0].heads, tokenizer),
        runs[0],
        heldout,
        1.0,
        max_new_tokens=8,
        stop_token_ids=(),
    )
    counts = ("tau", "acceptance_by_depth", "target_forwards", "decode_tokens")
    for category, result in again["categories"].items():
        assert {k: result[k] for k in counts} == {
            k: rows[1]["categories"][category][k] for k in counts
        }
    # With context drafts the row says so (the loop's own tests check what they change).
    with_context = tau_heldout.measure_run(
        tau_heldout.SpeculativeGenerator(model, runs[0].heads, tokenizer),
        replace(runs[0], name="eagle + context", context_drafts=ContextDrafts(max_tokens=3)),
        heldout,
        0.0,
        max_new_tokens=8,
        stop_token_ids=(),
    )
    assert with_context["heads"] == "eagle + context"
    assert with_context["context_drafts"]["max_tokens"] == 3 and rows[0]["context_drafts"] is None
    # The tables render every row and every category, and the report is JSON.
    report = {
        "date": "today",
        "machine": {"cpu": "cpu", "flags": [], "kernels": "torch"},
        "settings": {
            "categories": list(CATEGORIES),
            "prompts": len(heldout),
            "per_category": "2 each",
            "dtype": "float32",
            "max_new_tokens": 8,
            "tree": vars(TREE),
            "seed": 0,
        },
        "dedup": {"ngram": 5, "training_prompts": 0, "max_jaccard": 0.0, "threshold": 0.5},
        "rows": rows,
    }
    json.dumps(report)
    table = tau_heldout.markdown(report)
    assert all(c in table for c in CATEGORIES)
    assert "| medusa | 1 | dynamic k3 d2 n9 (depth capped at its 2 heads) |" in table


def test_dedup_catches_a_near_duplicate(tau_heldout: ModuleType) -> None:
    text = (
        "Summarize the following meeting notes in three bullet points for the team: the "
        "budget was approved, the launch moves to May, and hiring pauses until the autumn review."
    )
    heldout = [
        tau_heldout.HeldoutPrompt("sum-01", "summarization", text),
        tau_heldout.HeldoutPrompt("qa-01", "qa", "Why is the sky blue during the day?"),
    ]
    training = [
        ("train.jsonl:1", text.replace("May", "June")),
        ("train.jsonl:2", "Write a haiku about autumn leaves falling on a quiet pond."),
    ]
    nearest = tau_heldout.nearest_training(heldout, training, n=5)
    assert nearest[0].source == "train.jsonl:1" and nearest[0].jaccard >= 0.5
    assert nearest[1].jaccard < 0.5
    duplicates = tau_heldout.near_duplicates(nearest, 0.5)
    assert [d.heldout_id for d in duplicates] == ["sum-01"]


def test_dedup_passes_distinct_prompts(tau_heldout: ModuleType, tmp_path: Path) -> None:
    train = tmp_path / "prompts.jsonl"
    train.write_text(
        json.dumps({"prompt": "Explain how a hash map resolves collisions with chaining."})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Name three rivers in Peru."}]})
        + "\n"
    )
    heldout = [
        tau_heldout.HeldoutPrompt("qa-01", "qa", "Why do cats purr when they are content?"),
        tau_heldout.HeldoutPrompt("math-01", "math", "A train travels 60 km in 45 minutes."),
    ]
    report = tau_heldout.check_deduplicated(heldout, [train], make_tiny_tokenizer(), 0.5, 5)
    assert report["passed"] and report["training_prompts"] == 2
    assert report["max_jaccard"] < 0.5 and not report["duplicates"]


def test_dedup_reads_a_distilled_dataset(tau_heldout: ModuleType, distilled: Path) -> None:
    """Prompts decoded from a distilled dataset's token ids, the chat template's frame removed."""
    tokenizer = make_tiny_tokenizer()
    training = tau_heldout.read_training_prompts(distilled, tokenizer)
    assert sorted(text for _, text in training) == sorted(set(PROMPTS))
    heldout = [
        tau_heldout.HeldoutPrompt("qa-01", "qa", PROMPTS[0]),
        tau_heldout.HeldoutPrompt("qa-02", "qa", "how do volcanoes form under the sea"),
    ]
    report = tau_heldout.check_deduplicated(heldout, [distilled], tokenizer, 0.5, 5)
    assert not report["passed"]
    assert [d["heldout_id"] for d in report["duplicates"]] == ["qa-01"]
