"""The CI smoke of the data engine (train/recipes/smoke-datagen.yaml, < 2 min): `selfspec datagen`
-> `selfspec train` (EAGLE-3, a few steps, on the engine's responses and follow-ups with the
features it cached, so the target never runs in training) -> load -> speculative greedy ==
vanilla."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import Eagle3Head, load_heads
from selfspec.target import TargetSpec, apply_chat_template, load_target
from selfspec.train import module as module_file
from selfspec.train.cli import datagen_main, train_main
from selfspec.train.datagen import engine as engine_module

RECIPES = Path(__file__).resolve().parents[2] / "train" / "recipes"
PASSAGES = [f"Passage {i} tells about rivers, hills and the town of Number{i}." for i in range(8)]


def test_datagen_then_train_then_speculate_losslessly(
    chatty_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = time.perf_counter()
    monkeypatch.setattr(engine_module, "installed_passages", lambda: list(PASSAGES))
    data = tmp_path / "engine"
    assert (
        datagen_main(
            [
                "--config",
                str(RECIPES / "smoke-datagen.yaml"),
                "--output",
                str(data),
                "--target.model",
                str(chatty_target),
                "--features_dir",
                str(tmp_path / "features"),
            ]
        )
        == 0
    )
    assert json.loads((data / "engine.json").read_text())["stages"]["followups"]["rows"] > 0

    # Training reads the cached states: every batch brings them, the target never runs for it.
    original = module_file.HeadsModule._eagle3_inputs
    batches = []

    def from_cache_only(self, batch):
        assert "layer_features" in batch and "features" in batch, "the target would run"
        batches.append(batch["layer_features"].shape)
        return original(self, batch)

    monkeypatch.setattr(module_file.HeadsModule, "_eagle3_inputs", from_cache_only)
    out = tmp_path / "heads"
    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hi", "tell me")))
    assert (
        train_main(
            [
                "--config",
                str(RECIPES / "smoke-eagle3.yaml"),
                "--model.target.model",
                str(chatty_target),
                "--data.train_data",
                json.dumps([str(data / "responses"), str(data / "followups")]),
                "--trainer.default_root_dir",
                str(tmp_path / "run"),
                "--export.output_dir",
                str(out),
                "--export.tau_prompts",
                str(prompts),
                "--export.snapshot_every_tokens",
                "40",
            ]
        )
        == 0
    )
    assert json.loads((out / "metrics.json").read_text())["global_step"] == 4
    assert len(batches) >= 8 and all(shape[-1] == 3 * 32 for shape in batches)
    snapshots = sorted((tmp_path / "heads-snapshots").glob("tokens-*"))
    assert len(snapshots) >= 2, "a snapshot per 40 response tokens trained on"
    seen = [
        json.loads((s / "metrics.json").read_text())["response_tokens_seen_this_run_rank0"]
        for s in snapshots
    ]
    assert seen == sorted(seen) and seen[0] >= 40
    first = json.loads((out / "metrics.json").read_text())
    assert first["response_tokens_total"] == first["response_tokens_seen_this_run_rank0"]
    # Where the seeded batch order stands: 4 optimizer steps x 2 accumulated batches, over as
    # many epochs of the order as that took.
    full = first["epoch_batches"]
    assert first["data_epoch"] * full + first["batches_done"] == 4 * 2

    # A run continued from the exported heads counts the tokens they were trained on before.
    continued = tmp_path / "heads-continued"
    assert (
        train_main(
            [
                "--config",
                str(RECIPES / "smoke-eagle3.yaml"),
                "--model.target.model",
                str(chatty_target),
                "--model.init_from",
                str(out),
                "--data.train_data",
                json.dumps([str(data / "responses")]),
                "--trainer.default_root_dir",
                str(tmp_path / "run-continued"),
                "--trainer.max_steps",
                "1",
                "--data.skip_batches",
                "1",
                "--export.output_dir",
                str(continued),
            ]
        )
        == 0
    )
    second = json.loads((continued / "metrics.json").read_text())
    assert second["init_from"] == str(out)
    # The skipped batch, then this run's: one optimizer step of up to 2 batches (fewer when
    # the epoch ends first).
    position = second["data_epoch"] * second["epoch_batches"] + second["batches_done"]
    assert 1 + 1 <= position <= 1 + 2
    assert second["response_tokens_before_this_run"] == first["response_tokens_total"]
    assert second["response_tokens_total"] == (
        first["response_tokens_total"] + second["response_tokens_seen_this_run_rank0"]
    )
    assert second["response_tokens_seen_this_run_rank0"] > 0

    target = load_target(TargetSpec(model=str(chatty_target)))
    heads = load_heads(out, target.model)
    assert isinstance(heads, Eagle3Head)
    assert isinstance(load_heads(snapshots[0], target.model), Eagle3Head)
    generator = SpeculativeGenerator(target.model, heads, target.tokenizer)
    for prompt in ("hi", "write a poem", "what is 2 + 2?"):
        ids = apply_chat_template(target.tokenizer, prompt)
        vanilla = generator.generate(ids, GenerationConfig(max_new_tokens=12, speculate=False))
        speculative = generator.generate(ids, GenerationConfig(max_new_tokens=12))
        assert speculative.token_ids == vanilla.token_ids
    assert time.perf_counter() - started < 120
