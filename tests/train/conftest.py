"""Fixtures of the training tests: a tiny target on disk, prompts, and a distilled dataset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model, make_tiny_tokenizer
from train_helpers import PROMPTS, write_prompts

from selfspec.target import TargetSpec
from selfspec.train.distill import DistillConfig, distill


@pytest.fixture(autouse=True, scope="session")
def one_thread() -> None:
    """Tiny models gain nothing from more threads, and the CPU is shared with other tests."""
    torch.set_num_threads(1)


def save_peaked_target(path: Path, seed: int) -> Path:
    """A tiny Llama (tied embeddings, like SmolLM2) whose next-token distributions are peaked.

    A random init gives near-uniform logits (std ~0.1), which leave heads nothing to learn;
    scaling the tied embedding makes the target confident, like a trained model.
    """
    model = make_tiny_model("llama", seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(100.0)
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target and its tokenizer as a local HF directory."""
    return save_peaked_target(tmp_path_factory.mktemp("target") / "llama", seed=0)


@pytest.fixture(scope="session")
def other_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and sizes, other weights: a different base."""
    return save_peaked_target(tmp_path_factory.mktemp("target") / "llama-other", seed=1)


@pytest.fixture(scope="session")
def distilled(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 distilled rows (3 shards of 8), features stored."""
    root = tmp_path_factory.mktemp("distilled")
    prompts = write_prompts(root / "prompts.jsonl", PROMPTS)
    config = DistillConfig(
        prompts=str(prompts),
        output=str(root / "data"),
        target=TargetSpec(model=str(tiny_target)),
        max_new_tokens=16,
        batch_size=8,
        shard_size=8,
    )
    distill(config)
    return root / "data"


@pytest.fixture(scope="session")
def chatty_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama that answers anything with " wo." and ends its turn: a bigram model (the
    layers' output projections zeroed, so the stream is the token's embedding) whose lm_head maps
    any character to " ", " " to "w", "w" to "o", "o" to "." and "." to EOS. The data engine's
    user turns and responses then end, and have words, as a real model's do."""
    from tiny_models import VOCAB_SIZE, tiny_config
    from transformers import AutoModelForCausalLM

    tokenizer = make_tiny_tokenizer()
    config = tiny_config("llama")
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config).eval()
    chain = [" ", "w", "o", ".", "</s>"]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.get_input_embeddings().weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        for token in range(VOCAB_SIZE):
            name = tokenizer.convert_ids_to_tokens(token)
            embed[token, chain.index(name) + 1 if name in chain[:-1] else 0] = 1.0
        for state, successor in enumerate(chain):
            head[tokenizer.convert_tokens_to_ids(successor), state] = 2.0
    path = tmp_path_factory.mktemp("target") / "chatty"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
