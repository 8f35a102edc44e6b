"""Sampled output of the whole engine has exactly the target's distribution.

A tiny Llama with a 6-token vocabulary generates 3 tokens many times, speculating with perturbed
heads (so drafts are often wrong); the empirical distribution of the 64 possible sequences is
compared with the exact one, computed by enumerating every prefix through the target. The bound
is calibrated by drawing the same number of sequences from the exact distribution itself, and a
deliberately wrong residual (bonus drawn from the target instead of the residual after a
rejection) must fail the same check — so the test can fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import selfspec.verify as verify_module
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.sampling import SamplingParams
from selfspec.tree import DraftSampling, DynamicTree, StaticTree, TreeSpec

VOCAB = 4
NEW_TOKENS = 3
SAMPLES = 1500
PROMPT = [1, 3, 2]
SAMPLING = SamplingParams(temperature=1.0)


def _peaky_tiny_llama() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sharper distributions: a biased sampler shows up sooner
        model.lm_head.weight.mul_(6.0)
    return model


def _exact_distribution(model: torch.nn.Module) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) for every sequence, by enumeration. # [VOCAB ** 3]"""
    sequences = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW_TOKENS)))  # [64, 3]
    inputs = torch.cat([torch.tensor(PROMPT).expand(len(sequences), -1), sequences], dim=1)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(inputs).logits.float(), dim=-1)  # [64, P+3, V]
    start = len(PROMPT) - 1
    picked = logprobs[:, start : start + NEW_TOKENS].gather(-1, sequences.unsqueeze(-1))
    return picked.squeeze(-1).sum(-1).exp()


def _empirical(
    generator: SpeculativeGenerator, tree: TreeSpec, sampling: DraftSampling
) -> torch.Tensor:
    counts = torch.zeros(VOCAB**NEW_TOKENS)
    for seed in range(SAMPLES):
        config = GenerationConfig(
            max_new_tokens=NEW_TOKENS,
            sampling=SAMPLING,
            seed=seed,
            stop_token_ids=(),
            tree=tree,
            draft_sampling=sampling,
        )
        t1, t2, t3 = generator.generate(PROMPT, config).token_ids
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
    return counts / SAMPLES


def _null_tv_bound(exact: torch.Tensor) -> float:
    """Largest total variation seen between `exact` and SAMPLES draws from it, over 20 trials."""
    rng = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(20):
        draws = torch.multinomial(exact, SAMPLES, replacement=True, generator=rng)
        empirical = torch.bincount(draws, minlength=len(exact)).float() / SAMPLES
        worst = max(worst, 0.5 * float((empirical - exact).abs().sum()))
    return worst


@pytest.fixture(scope="module")
def setting() -> tuple[torch.nn.Module, torch.Tensor, float]:
    model = _peaky_tiny_llama()
    exact = _exact_distribution(model)
    return model, exact, _null_tv_bound(exact)


def _perturbed_heads(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    heads = build_heads(heads_config_for(model, kind, num_heads=2, num_attention_heads=2)).eval()
    torch.manual_seed(11)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    return heads


CASES = [
    ("medusa", StaticTree.chain(2), DraftSampling.TOP_K),
    ("eagle", StaticTree.full((2, 2)), DraftSampling.TOP_K),
    ("eagle", StaticTree.full((3, 1)), DraftSampling.WITHOUT_REPLACEMENT),
    # 4 of 9 drafted nodes kept by their ranks' values; verified as draws.
    ("eagle", DynamicTree(top_k=3, depth=2, budget=4), DraftSampling.WITHOUT_REPLACEMENT),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "tree", "draft_sampling"), CASES)
def test_speculative_sampling_matches_target(setting, kind, tree, draft_sampling) -> None:
    model, exact, bound = setting
    generator = SpeculativeGenerator(model, _perturbed_heads(model, kind))
    empirical = _empirical(generator, tree, draft_sampling)
    tv = 0.5 * float((empirical - exact).abs().sum())
    assert tv <= 1.15 * bound, f"TV {tv:.4f} above the sampling-noise bound {bound:.4f}"


@pytest.mark.slow
def test_wrong_residual_is_detected(setting, monkeypatch) -> None:
    """Negative control: drawing the bonus from p instead of the residual biases the output."""
    model, exact, bound = setting
    monkeypatch.setattr(verify_module, "_residual", lambda residual, token, proposal: residual)
    generator = SpeculativeGenerator(model, _perturbed_heads(model, "eagle"))
    empirical = _empirical(generator, StaticTree.full((2, 2)), DraftSampling.TOP_K)
    tv = 0.5 * float((empirical - exact).abs().sum())
    assert tv > 1.5 * bound, f"the biased verifier went unnoticed: TV {tv:.4f}, bound {bound:.4f}"
