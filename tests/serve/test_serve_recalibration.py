"""Background recalibration from served outputs (``selfspec serve --recalibrate``): an adapter's
speculating requests record their features, a draft delta is trained on them in a separate
process and swapped in between engine rounds when it measures better on a held-back slice;
greedy outputs never change; a failed attempt leaves the server serving; only flagged adapters
(trigger "drift") record anything."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch
from tiny_models import make_tiny_model, make_tiny_tokenizer

from selfspec.fingerprint import fingerprint_of
from selfspec.heads import build_heads, heads_config_for, save_heads
from selfspec.heads.delta import load_delta
from selfspec.serve.drift import DriftConfig, DriftMonitor
from selfspec.serve.recalibration import RecalibrationPolicy, ServedRecalibrator
from selfspec.stats import StepRecord

PROMPTS = [f"{a}{b} and then some more words about {b}" for a in "abcdefghijkl" for b in "uvwxyz"]
BODY = {"temperature": 0, "max_tokens": 40, "ignore_eos": True, "model": "attn"}


def _complete(url: str, prompt: str, **extra: object) -> dict:
    reply = httpx.post(
        f"{url}/v1/completions", json={**BODY, "prompt": prompt, **extra}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def _lively_target(root: Path) -> tuple[Path, Path]:
    """A tiny Llama whose weights are redrawn large enough to write varied text (at the default
    init it repeats itself, which untrained heads already predict), and untrained heads for it."""
    model = make_tiny_model("llama", 0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                std = 0.5 if "embed" in name else 0.2
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(root / "lively")
    make_tiny_tokenizer().save_pretrained(root / "lively")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        heads = build_heads(heads_config_for(model, "eagle"))
    save_heads(heads, root / "heads", fingerprint_of(model))
    return root / "lively", root / "heads"


def test_served_outputs_train_a_delta_that_is_swapped_in_and_outputs_stay_equal(
    server_for, assets, tmp_path: Path
) -> None:
    root = tmp_path / "adapters"
    shutil.copytree(assets["adapters"], root)
    target, heads = _lively_target(tmp_path)
    settings = {"model": str(target), "heads": str(heads), "adapters_root": str(root)}
    recalibrate = {
        "recalibrate": "always",
        "recalibrate_conversations": 48,
        "recalibrate_save": True,
    }
    with server_for(**settings, **recalibrate) as (
        url,
        state,
        _,
    ):
        vanilla = {p: _complete(url, p, speculation=False)["choices"][0]["text"] for p in PROMPTS}
        before = [_complete(url, p) for p in PROMPTS[:48]]  # these 48 are gathered and trained on
        assert state.recalibrator.wait_idle(240)
        outcomes = state.recalibrator.outcomes
        assert [o.outcome for o in outcomes] == ["swapped"], [o.report for o in outcomes]
        report = outcomes[0].report
        assert report["train_rows"] == 36 and report["heldout_rows"] == 12
        assert report["after"]["top1"] >= report["served"]["top1"] + 0.01
        after = [_complete(url, p) for p in PROMPTS]  # the delta drafts from the next round on
        assert "attn" in state.delta_bank
        saved = load_delta(
            root / "attn" / "heads-delta", state.generator.heads
        )  # --recalibrate-save
        assert saved.heads_hash == state.delta_bank.hash
        for prompt, reply in zip(PROMPTS, before + after[48:], strict=True):
            assert reply["choices"][0]["text"] == vanilla[prompt]
        for prompt, reply in zip(PROMPTS, after, strict=True):
            assert reply["choices"][0]["text"] == vanilla[prompt]
        tau_before = sum(r["selfspec"]["tau"] for r in before) / len(before)
        tau_after = sum(r["selfspec"]["tau"] for r in after[:48]) / 48
        assert tau_after > tau_before, (tau_before, tau_after)
        exposition = httpx.get(f"{url}/metrics").text
        assert (
            'selfspec_background_recalibrations_total{adapter="attn",outcome="swapped"} 1.0'
            in exposition
        )
        # once is enough under "always": the adapter records nothing more unless flagged
        assert not state.records_features("attn", state.generator)


def _recalibrator(tmp_path: Path, monitor: DriftMonitor, heads: Path) -> ServedRecalibrator:
    return ServedRecalibrator(
        RecalibrationPolicy(conversations=4, steps=2),
        heads,
        model=None,
        drift=monitor,
        install=lambda adapter, directory: pytest.fail("nothing should be installed"),
        current_delta=lambda adapter: None,
        work_root=tmp_path,
    )


def test_only_flagged_adapters_record_and_a_failed_attempt_is_reported(
    server_for, assets, tmp_path: Path
) -> None:
    monitor = DriftMonitor("base", DriftConfig(threshold=0.8, min_steps=4))
    recalibrator = _recalibrator(tmp_path, monitor, tmp_path / "no-such-heads")
    assert not recalibrator.wants("attn") and not recalibrator.wants(None)
    monitor.observe("base", [StepRecord(accepted=3, tree_size=8, tree_depth=4)] * 8)
    monitor.observe("attn", [StepRecord(accepted=0, tree_size=8, tree_depth=4)] * 8)
    monitor.observe("mlp", [StepRecord(accepted=3, tree_size=8, tree_depth=4)] * 8)
    assert monitor.flagged() == {"attn"}
    assert recalibrator.wants("attn") and not recalibrator.wants("mlp")
    with server_for() as (url, state, _):
        from dataclasses import replace

        from selfspec.generation import GenerationConfig

        config = GenerationConfig(max_new_tokens=12, stop_token_ids=(), record_features=True)
        ids = [1, 5, 9, 14]
        results = [state.generator.generate(ids, replace(config, seed=seed)) for seed in range(4)]
    for result in results:
        recalibrator.collect("attn", ids, result)
    assert recalibrator.wait_idle(120)
    (outcome,) = recalibrator.outcomes
    assert outcome.outcome == "failed" and "no-such-heads" in outcome.detail
    assert recalibrator.wants("attn")  # flagged still, and attempts are left
    recalibrator.close()
    assert not list(tmp_path.glob("selfspec-recalibrate-*"))  # its work files are gone


def test_bad_policies_and_flags_are_refused() -> None:
    with pytest.raises(ValueError, match="trigger"):
        RecalibrationPolicy(trigger="sometimes")
    with pytest.raises(ValueError, match="held_back"):
        RecalibrationPolicy(held_back=1.0)
    from selfspec.serve.cli import ServeArgs

    with pytest.raises(ValueError, match="--recalibrate"):
        ServeArgs(recalibrate="yes")
    with pytest.raises(ValueError, match="needs draft heads"):
        ServeArgs(recalibrate="drift", heads="none")


def test_eagle3_heads_recalibrate_from_the_tapped_states_requests_record(tmp_path: Path) -> None:
    """EAGLE-3 heads read the target's states at their layers: a served request records them
    beside the last hidden state, and the training process fits a delta on both."""
    from selfspec.generation import GenerationConfig, SpeculativeGenerator
    from selfspec.heads import load_heads
    from selfspec.target import TargetSpec, load_target

    target_dir, _ = _lively_target(tmp_path)
    target = load_target(TargetSpec(model=str(target_dir)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        heads = build_heads(heads_config_for(target.model, "eagle3"))
    heads_dir = save_heads(heads, tmp_path / "eagle3", fingerprint_of(target.model))
    generator = SpeculativeGenerator(target.model, load_heads(heads_dir, target.model))
    installed = []
    recalibrator = ServedRecalibrator(
        RecalibrationPolicy(trigger="always", conversations=4, steps=3, min_gain=0.0),
        heads_dir,
        model=str(target_dir),
        drift=DriftMonitor("base", DriftConfig()),
        install=lambda adapter, directory: installed.append((adapter, directory)),
        current_delta=lambda adapter: None,
        work_root=tmp_path,
    )
    assert recalibrator.wants("attn")
    config = GenerationConfig(max_new_tokens=16, stop_token_ids=(), record_features=True)
    for first in range(4):
        prompt = [first + 1, 5, 9, 14, 3]
        recalibrator.collect("attn", prompt, generator.generate(prompt, config))
    assert recalibrator.wait_idle(240)
    (outcome,) = recalibrator.outcomes
    assert outcome.outcome in ("swapped", "kept"), outcome.detail
    assert (outcome.report["train_rows"], outcome.report["heldout_rows"]) == (3, 1)
    assert outcome.report["steps"] == 3
    swapped = outcome.outcome == "swapped"
    assert [adapter for adapter, _ in installed] == (["attn"] if swapped else [])
    recalibrator.close()
