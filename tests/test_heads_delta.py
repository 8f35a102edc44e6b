"""Per-adapter draft deltas: a trainable low-rank delta starts at the shared heads, trains only
its own parameters, saves and loads (refused on other heads or malformed), and a bank applies
each adapter's delta only while it is active, with speculation still lossless."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.heads.checkpoint import read_heads_config
from selfspec.heads.delta import (
    Delta,
    DeltaBank,
    DeltaConfig,
    DeltaError,
    delta_state,
    heads_hash,
    load_delta,
    save_delta,
    with_trainable_delta,
)
from selfspec.shipped import shipped_heads_dir
from selfspec.tree import DynamicTree


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", 0)


def _heads(model, kind: str = "eagle"):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        heads = build_heads(heads_config_for(model, kind))
        with torch.no_grad():
            for param in heads.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    return heads.eval()


def _inputs(heads):
    torch.manual_seed(1)
    hidden = heads.config.hidden_size
    width = hidden * (len(heads.config.target_layers) if heads.config.target_layers else 1)
    return (torch.randn(1, 5, hidden), torch.randn(1, 5, width if width != hidden else hidden),
            torch.arange(1, 6)[None])  # fmt: skip


def _trained_delta(heads, steps: int = 3) -> tuple[torch.nn.Module, Delta]:
    shared_hash = heads_hash(heads)
    trainable = with_trainable_delta(copy.deepcopy(heads), DeltaConfig(rank=4, alpha=8))
    optimizer = torch.optim.SGD([p for p in trainable.parameters() if p.requires_grad], lr=0.5)
    for _ in range(steps):
        optimizer.zero_grad()
        embeds, features, positions = _inputs(heads)
        features = heads.fuse(features) if hasattr(heads, "fc") else features
        trainable(embeds, features, positions).square().mean().backward()
        optimizer.step()
    return trainable, Delta(DeltaConfig(rank=4, alpha=8), shared_hash, delta_state(trainable))


def _assert_lossless(model, banked, bank: DeltaBank, name: str) -> None:
    """Speculation with ``name``'s delta active drafting gives vanilla greedy's tokens."""
    generator = SpeculativeGenerator(model, banked)
    prompt = [1, 5, 9, 13, 2]
    plain = generator.generate(prompt, GenerationConfig(max_new_tokens=24, speculate=False))
    spec = generator.generate(
        prompt,
        GenerationConfig(max_new_tokens=24, tree=DynamicTree()),
        scope=lambda: bank.active(name),
    )
    assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_delta_starts_at_the_shared_heads_and_trains_only_itself(model, kind: str) -> None:
    heads = _heads(model, kind)
    trainable = with_trainable_delta(copy.deepcopy(heads), DeltaConfig(rank=4, alpha=8))
    embeds, features, positions = _inputs(heads)
    features = heads.fuse(features) if kind == "eagle3" else features
    torch.testing.assert_close(
        trainable(embeds, features, positions), heads(embeds, features, positions)
    )
    trained = {n for n, p in trainable.named_parameters() if p.requires_grad}
    assert trained and all(n.endswith(("lora_A", "lora_B")) for n in trained)
    _, delta = _trained_delta(heads)
    assert any(t.abs().sum() > 0 for k, t in delta.state.items() if k.endswith("lora_B"))


def test_rank_16_delta_is_a_few_percent_of_the_shipped_heads() -> None:
    config = read_heads_config(shipped_heads_dir("eagle"))[0]
    heads = build_heads(config)
    shared = sum(p.numel() for p in heads.parameters())
    with_trainable_delta(heads, DeltaConfig(rank=16))
    low_rank = sum(p.numel() for n, p in heads.named_parameters() if "lora_" in n)
    assert low_rank / shared < 0.05


def test_save_load_and_refusals(model, tmp_path: Path) -> None:
    heads = _heads(model)
    _, delta = _trained_delta(heads)
    path = save_delta(delta, tmp_path / "heads-delta", extra={"recalibrated_for": "x"})
    loaded = load_delta(path, heads)
    assert loaded.config == delta.config and loaded.state.keys() == delta.state.keys()
    other = copy.deepcopy(heads)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)  # other shared heads (e.g. retrained)
    with pytest.raises(DeltaError, match="corrects other heads"):
        load_delta(path, other)
    # A caller holding the heads' hash (a DeltaBank) skips hashing them; the check still holds.
    assert load_delta(path, heads, heads_hash(heads)).state.keys() == delta.state.keys()
    with pytest.raises(DeltaError, match="corrects other heads"):
        load_delta(path, other, heads_hash(other))
    broken = copy.deepcopy(delta.state)
    key = next(k for k in broken if k.endswith("lora_A"))
    broken[key] = torch.zeros(3, 3)
    save_delta(Delta(delta.config, delta.heads_hash, broken), tmp_path / "bad")
    with pytest.raises(DeltaError, match="has shape"):
        load_delta(tmp_path / "bad", heads)
    with pytest.raises(DeltaError, match="not a readable draft delta"):
        load_delta(tmp_path / "missing", heads)


def test_the_bank_applies_a_delta_only_while_active_and_stays_lossless(model) -> None:
    heads = _heads(model)
    trained, delta = _trained_delta(heads)
    embeds, features, positions = _inputs(heads)
    want_shared = heads(embeds, features, positions)
    want_adapted = trained(embeds, features, positions)
    banked = copy.deepcopy(heads)
    bank = DeltaBank(banked)
    assert heads_hash(banked) == heads_hash(heads)  # wrapping changes nothing it hashes
    bank.add("shout", delta)
    assert "shout" in bank and bank.nbytes == delta.nbytes
    torch.testing.assert_close(banked(embeds, features, positions), want_shared)
    with bank.active("shout"):
        torch.testing.assert_close(banked(embeds, features, positions), want_adapted)
    with bank.active("no-delta"):  # an adapter without a delta drafts with the shared heads
        torch.testing.assert_close(banked(embeds, features, positions), want_shared)
    _assert_lossless(model, banked, bank, "shout")
    bank.remove("shout")
    assert "shout" not in bank and bank.nbytes == 0


def test_a_delta_may_bring_its_own_draft_vocabulary(model, tmp_path: Path) -> None:
    """Saved with the delta and checked on load; while its adapter is active the drafts come
    from those tokens (the lm_head's rows read in place on the kernels); output stays lossless;
    other adapters and the base keep the heads' vocabulary."""
    from dataclasses import replace

    from selfspec.drafting.projection import DraftProjection
    from selfspec.kernels.modules import install_kernels

    heads = _heads(model)
    _, delta = _trained_delta(heads)
    vocab_size = heads.config.vocab_size
    own = torch.tensor([3, 5, 8, 13, 21, 34, 55, vocab_size - 1])
    with_vocab = replace(delta, draft_vocab=own)
    path = save_delta(with_vocab, tmp_path / "with-vocab")
    loaded = load_delta(path, heads)
    assert torch.equal(loaded.draft_vocab, own) and loaded.nbytes == delta.nbytes + own.nbytes
    assert load_delta(save_delta(delta, tmp_path / "without"), heads).draft_vocab is None
    for bad in (torch.tensor([3, 3]), torch.tensor([vocab_size])):
        save_delta(replace(delta, draft_vocab=bad), tmp_path / "bad-vocab")
        with pytest.raises(DeltaError, match="draft vocabulary"):
            load_delta(tmp_path / "bad-vocab", heads)

    target = make_tiny_model("llama", 0).eval()
    install_kernels(target, "float32")
    banked = copy.deepcopy(heads)
    bank = DeltaBank(banked)
    bank.add("own", loaded)
    bank.add("shared", delta)
    projection = DraftProjection(target.lm_head, None, banked)
    features = torch.randn(2, target.config.hidden_size)
    with torch.inference_mode():
        full = target.lm_head(features)
        with bank.active("own"):
            assert bank.active_draft_vocab() is not None and projection.size == len(own)
            assert torch.equal(projection.logits(features), full[:, own])
            assert projection.token_ids(torch.tensor([0, 7, -1])).tolist() == [
                3,
                vocab_size - 1,
                -1,
            ]
            assert torch.equal(projection.to_full(torch.ones(1, len(own)))[0].nonzero()[:, 0], own)
        for name in ("shared", None):
            with bank.active(name):
                assert projection.size == vocab_size
                assert torch.equal(projection.logits(features), full)
    _assert_lossless(target, banked, bank, "own")
    bank.remove("own")
    with bank.active("own"):
        assert bank.active_draft_vocab() is None
