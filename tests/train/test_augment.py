"""Shared heads fine-tuned under the team's adapters (``selfspec.train.augment``): rows distilled
under each adapter and the base, the heads trained on them, written as a loadable heads
directory that keeps the start heads' draft vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tiny_models import make_tiny_model

from selfspec.fingerprint import fingerprint_of
from selfspec.heads import build_heads, heads_config_for, load_heads, save_heads
from selfspec.heads.draft_vocab import draft_vocab_of, set_draft_vocab
from selfspec.target import TargetSpec, load_target
from selfspec.train import augment


def _adapter(path: Path, seed: int) -> None:
    """A LoRA adapter of the tiny Llama with random non-zero weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(make_tiny_model("llama", 0), LoraConfig(r=4, lora_alpha=8))
        for name, param in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=0.5)
    model.save_pretrained(path, safe_serialization=True)


def test_heads_trained_under_adapters_keep_their_draft_vocabulary(
    tiny_target: Path, tmp_path: Path, capsys
) -> None:
    model = load_target(TargetSpec(model=str(tiny_target))).model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        heads = build_heads(heads_config_for(model, "eagle", draft_vocab_size=40))
    set_draft_vocab(heads, torch.arange(3, 83, 2))
    save_heads(heads, tmp_path / "heads", fingerprint_of(model))
    for index, name in enumerate(("one", "two")):
        _adapter(tmp_path / "adapters" / name, seed=index + 1)
    code = augment.main(
        [
            "--model", str(tiny_target),
            "--heads", str(tmp_path / "heads"),
            "--adapters-root", str(tmp_path / "adapters"),
            "--adapters", "one", "two",
            "--prompts-per-target", "4",
            "--max-new-tokens", "8",
            "--steps", "3",
            "--out", str(tmp_path / "augmented"),
        ]
    )  # fmt: skip
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["augmented_with"] == ["(base)", "one", "two"] and record["steps"] == 3
    trained = load_heads(tmp_path / "augmented", model)
    assert torch.equal(draft_vocab_of(trained), torch.arange(3, 83, 2))
    moved = [
        not torch.equal(a, b)
        for (name, a), b in zip(
            trained.state_dict().items(), heads.state_dict().values(), strict=True
        )
        if name != "draft_vocab"
    ]
    assert any(moved)  # the weights were trained
