"""Sampling parameters and the warp that turns logits into the distribution we sample from.

The same warp (temperature, top-k, top-p) is applied to the target when verifying, so the
sampled output has exactly the warped target distribution; drafts may use it too, which only
changes how often they are accepted, never what comes out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is shaped. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    """0 for greedy (argmax); otherwise logits are divided by it before the softmax."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 keeps all."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and self.temperature == self.temperature):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """# [..., vocab] -> [...]: the index of each row's first maximum, exactly ``argmax``'s
    answer; ``max`` gets it 2-3x faster than ``argmax`` on bf16 logits on CPU (measured)."""
    return logits.max(-1).indices


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target (or draft) probabilities after temperature, top-k and top-p.

    logits: # [..., vocab] -> probs: # [..., vocab], float32, rows sum to 1.
    For greedy params this is the one-hot of the argmax, the limit of temperature -> 0.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [..., vocab]
        # A token is kept when the mass strictly before it is below top_p (the top one always).
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row. probs: # [..., vocab] -> # [...]"""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
