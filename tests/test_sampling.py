"""The sampling warp: temperature, top-k, top-p, greedy, and parameter validation.

Every expectation is computed independently of `warp_probs` (float64, by sorting), so a wrong
warp shows up as a mismatch rather than agreeing with itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from selfspec.sampling import SamplingParams, greedy_tokens, sample_from, warp_probs


def _logits(rows: int = 8, vocab: int = 37, seed: int = 0) -> torch.Tensor:
    """Random logits with distinct values (no ties), spread enough that top-p cuts vary."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * 2.0  # [rows, vocab]


def _reference_top_p_keep(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p (float64, by hand)."""
    order = sorted(range(probs.shape[0]), key=lambda t: -float(probs[t]))
    kept, mass = set(), 0.0
    for token in order:
        kept.add(token)
        mass += float(probs[token])
        if mass >= top_p:
            break
    return kept


def test_temperature_one_is_softmax() -> None:
    logits = _logits()
    probs = warp_probs(logits, SamplingParams(temperature=1.0))
    expected = torch.softmax(logits.double(), dim=-1)
    torch.testing.assert_close(probs.double(), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.8])
def test_temperature_scales_logits(temperature: float) -> None:
    logits = _logits(seed=1)
    probs = warp_probs(logits, SamplingParams(temperature=temperature))
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    torch.testing.assert_close(probs.double(), expected, atol=1e-6, rtol=1e-5)
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[0]), atol=1e-5)


def test_lower_temperature_sharpens() -> None:
    logits = _logits(seed=2)
    top = logits.argmax(-1, keepdim=True)
    cold = warp_probs(logits, SamplingParams(temperature=0.5)).gather(-1, top)
    hot = warp_probs(logits, SamplingParams(temperature=2.0)).gather(-1, top)
    assert (cold > hot).all()


def test_greedy_is_one_hot_argmax() -> None:
    logits = _logits(seed=3)
    probs = warp_probs(logits, SamplingParams(temperature=0.0))
    assert SamplingParams().greedy
    expected = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    assert torch.equal(probs, expected)


@pytest.mark.parametrize("top_k", [1, 2, 5, 36])
def test_top_k_keeps_exactly_k(top_k: int) -> None:
    logits = _logits(seed=4)  # [8, 37]
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
    for row in range(logits.shape[0]):
        kept = set(probs[row].nonzero().squeeze(1).tolist())
        expected = set(torch.topk(logits[row], top_k).indices.tolist())
        assert kept == expected
        # Renormalised softmax over the kept tokens only.
        index = torch.tensor(sorted(expected))
        reference = torch.softmax(logits[row, index].double(), dim=-1)
        torch.testing.assert_close(probs[row, index].double(), reference, atol=1e-6, rtol=1e-5)


def test_top_k_at_or_above_vocab_keeps_all() -> None:
    logits = _logits(seed=5)
    for top_k in (37, 50):
        probs = warp_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
        assert (probs > 0).all()


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.6, 0.9, 0.99])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float) -> None:
    logits = _logits(seed=6)
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    full = torch.softmax(logits.double(), dim=-1)
    for row in range(logits.shape[0]):
        expected = _reference_top_p_keep(full[row], top_p)
        # Guard: no cumulative mass within float noise of top_p, where float32 may legitimately
        # disagree with the float64 reference about the boundary token.
        cumulative = full[row].sort(descending=True).values.cumsum(0)
        assert (cumulative - top_p).abs().min() > 1e-5, "pick another seed: boundary tie"
        kept = set(probs[row].nonzero().squeeze(1).tolist())
        assert kept == expected
        index = torch.tensor(sorted(expected))
        reference = full[row, index] / full[row, index].sum()
        torch.testing.assert_close(probs[row, index].double(), reference, atol=1e-6, rtol=1e-5)


def test_top_p_small_keeps_only_the_top_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_p_hand_example() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 needs the first two (0.8), 0.85 the first three.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    two = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(two, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    three = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.85))
    torch.testing.assert_close(three, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_temperature_then_top_k_then_top_p() -> None:
    """The order HF uses: temperature, then top-k, then top-p on the renormalised top-k."""
    logits = _logits(rows=1, vocab=20, seed=7)[0]
    params = SamplingParams(temperature=0.6, top_k=6, top_p=0.8)
    probs = warp_probs(logits, params)
    scaled = logits.double() / 0.6
    top = torch.topk(scaled, 6).indices
    after_k = torch.zeros_like(scaled)
    after_k[top] = torch.softmax(scaled[top], dim=-1)
    kept = _reference_top_p_keep(after_k, 0.8)
    expected = torch.zeros_like(scaled)
    index = torch.tensor(sorted(kept))
    expected[index] = after_k[index] / after_k[index].sum()
    torch.testing.assert_close(probs.double(), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_edge_params_accepted() -> None:
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    SamplingParams(temperature=5.0, top_k=1, top_p=1e-9)


def test_sample_from_matches_probs_and_repeats_with_seed() -> None:
    probs = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])
    samples = 20_000
    rows = probs.expand(samples, -1)  # [N, vocab]
    first = sample_from(rows, torch.Generator().manual_seed(11))  # [N]
    again = sample_from(rows, torch.Generator().manual_seed(11))
    assert torch.equal(first, again)
    assert first.shape == (samples,)
    counts = torch.bincount(first, minlength=5).double()
    assert counts[2] == 0  # zero mass is never drawn
    # Total variation: E[TV] <= sum_i sqrt(p_i (1 - p_i) / N) / 2 ~= 0.0068 at N = 20k; a bound
    # of 0.02 is ~3x that and far below the smallest mass moved by a real bug (0.05).
    bound = 0.5 * sum(math.sqrt(p * (1 - p) / samples) for p in probs.tolist())
    tv = 0.5 * (counts / samples - probs.double()).abs().sum()
    assert tv < 3 * bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_is_argmax_ties_included(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    top = logits.max()
    logits[:, 17] = top
    logits[:, 3] = top  # a tie: the first maximum wins, as argmax
    logits[5] = 0.0  # an all-equal row
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert greedy_tokens(logits).tolist() == [3, 3, 3, 3, 3, 0]
