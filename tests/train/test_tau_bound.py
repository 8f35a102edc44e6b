"""benchmarks/tau_bound.py: the best tree's expected τ, found exactly, and decoding that samples
as the target does."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch
from benchmark_scripts import load_benchmark
from tiny_models import make_lively_model

from selfspec.sampling import SamplingParams, sample_from, warp_probs
from selfspec.target_forward import TargetForward

PROMPT = [5, 17, 42, 8, 63, 21]
PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def tau_bound() -> ModuleType:
    return load_benchmark("tau_bound")


@pytest.fixture(scope="module")
def target() -> TargetForward:
    return TargetForward(make_lively_model("llama"))


def _next_probs(target: TargetForward, sequences: torch.Tensor) -> torch.Tensor:
    """The target's distribution after each full sequence, no cache. # [B, S] -> [B, vocab]"""
    with torch.inference_mode():
        logits = target.model(input_ids=sequences).logits[:, -1]
    return warp_probs(logits, PARAMS)


def test_best_tree_is_the_brute_force_optimum(tau_bound: ModuleType, target: TargetForward) -> None:
    """Every path of depth ≤ 2 enumerated: the search's chosen nodes are the top-budget path
    probabilities, form a tree, and leave the cache as it found it."""
    budget, depth = 7, 2
    cache, committed = tau_bound.prefill(target, PROMPT)
    tree = tau_bound.best_tree(target, cache, committed, PROMPT[-1], PARAMS, budget, depth)
    assert cache.get_seq_length() == committed
    root = _next_probs(target, torch.tensor([PROMPT]))[0]  # [vocab]
    vocab = root.shape[0]
    firsts = torch.tensor([[*PROMPT, token] for token in range(vocab)])  # [vocab, S + 1]
    second = _next_probs(target, firsts)  # [vocab, vocab]
    paths = [root[a].item() for a in range(vocab)]
    paths += (root[:, None] * second).flatten().tolist()
    best = sorted(paths, reverse=True)[:budget]
    found = [math.exp(tree.nodes[i].log_prob) for i in tree.chosen]
    assert found == pytest.approx(best, rel=1e-4)
    assert tree.expected_tau(budget) == pytest.approx(1 + sum(best), rel=1e-5)
    assert tree.expected_tau(3) == pytest.approx(1 + sum(best[:3]), rel=1e-5)
    chosen = set(tree.chosen)
    for index in tree.chosen:
        parent = tree.nodes[index].parent
        assert parent == 0 or parent in chosen
        assert tree.nodes[index].depth <= depth


def test_decode_samples_as_the_target(tau_bound: ModuleType, target: TargetForward) -> None:
    """Speculating through the best trees commits the very tokens ancestral sampling draws from
    the same generator, and counts them step by step."""
    trace = tau_bound.decode(target, PROMPT, PARAMS, 8, 3, 20, seed=7, stop_ids=set())
    generator = torch.Generator().manual_seed(7)
    sequence = list(PROMPT)
    for _ in range(len(trace.tokens)):
        probs = _next_probs(target, torch.tensor([sequence]))[0]
        sequence.append(int(sample_from(probs, generator)))
    assert trace.tokens == sequence[len(PROMPT) :]
    assert sum(trace.committed) == len(trace.tokens) >= 20
    assert len(trace.expected[8]) == len(trace.committed)
    assert all(1.0 <= e <= 1 + 8 for e in trace.expected[8])
    assert all(a <= b for a, b in zip(trace.expected[4], trace.expected[8], strict=True))
    assert max(trace.committed) > 1  # the lively model is predictable enough to accept some
