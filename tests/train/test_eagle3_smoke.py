"""The CI smoke of EAGLE-3 training (train/recipes/smoke-eagle3.yaml, < 2 min): distilled data ->
`selfspec train` a few steps -> export -> load on the base -> speculative greedy == vanilla;
then a resumed run continues the step count from the last checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

from train_helpers import write_prompts

from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import Eagle3Head, load_heads
from selfspec.target import TargetSpec, apply_chat_template, load_target
from selfspec.train.cli import train_main

RECIPE = Path(__file__).resolve().parents[2] / "train" / "recipes" / "smoke-eagle3.yaml"
HELD_OUT = ["tell me about owls", "tell me about snow", "what is a map?"]


def test_smoke_recipe_trains_exports_and_speculates_losslessly(
    tiny_target: Path, distilled: Path, tmp_path: Path
) -> None:
    started = time.perf_counter()
    out, run = tmp_path / "heads", tmp_path / "run"
    prompts = write_prompts(tmp_path / "heldout.jsonl", HELD_OUT)
    args = [
        "--config",
        str(RECIPE),
        "--model.target.model",
        str(tiny_target),
        "--data.train_data",
        str(distilled),
        "--trainer.default_root_dir",
        str(run),
        "--export.output_dir",
        str(out),
        "--export.tau_prompts",
        str(prompts),
    ]
    assert train_main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["kind"] == "eagle3" and metrics["global_step"] == 4
    assert metrics["ttt"]["steps"] == 3 and metrics["target_layers"] == [0, 1, 1]
    assert metrics["train_tokens_per_s_rank0"] > 0
    assert set(metrics["tau"]["greedy"]) == {"dynamic", "static"}

    target = load_target(TargetSpec(model=str(tiny_target)))
    heads = load_heads(out, target.model)
    assert isinstance(heads, Eagle3Head) and heads.config.draft_vocab_size == 40
    generator = SpeculativeGenerator(target.model, heads, target.tokenizer)
    for prompt in HELD_OUT:
        ids = apply_chat_template(target.tokenizer, prompt)
        vanilla = generator.generate(ids, GenerationConfig(max_new_tokens=24, speculate=False))
        speculative = generator.generate(ids, GenerationConfig(max_new_tokens=24))
        assert speculative.token_ids == vanilla.token_ids

    # A killed run resumes: the same command with --ckpt_path last and a later max_steps.
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert train_main([*args, "--trainer.max_steps", "6", "--ckpt_path", "last"]) == 0
    assert json.loads((out / "metrics.json").read_text())["global_step"] == 6
    assert time.perf_counter() - started < 120
