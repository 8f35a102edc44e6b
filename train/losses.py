"""Training losses of the heads, each against the target's own outputs (self-distillation).

Notation: x_i are the tokens of a distilled row, f_i the target's feature (last hidden state)
after x_i, and ``target_probs`` at i = softmax(lm_head(f_i)), the target's distribution of x_{i+1}.
Only positions whose predicted token lies in the response are trained (the draft only ever runs
there); the prompt is context.

- Medusa head k at position t predicts x_{t+k+2}; its loss is the KL divergence from
  ``target_probs`` at t+k+1 (soft labels: the target's full distribution, not only its sample;
  KL = cross-entropy minus the target's entropy, so 0 is a perfect draft),
  weighted by ``decay**k`` and normalised by the sum of weights (the Medusa paper's 0.8^k).
- EAGLE input j is (embed(x_{j+1}), f_j) at position j+1; its output should equal f_{j+1}.
  Loss = ``feature_weight`` * smooth-L1(predicted, f_{j+1}) + ``token_weight`` * KL of
  lm_head(predicted) from ``target_probs`` at j+1. Weights 1.0 / 0.1 as in EAGLE: the
  regression carries the signal, the token term aligns what matters for acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LossWeights:
    """Weights of the loss terms."""

    feature_weight: float = 1.0
    """EAGLE: smooth-L1 regression of the next feature."""
    token_weight: float = 0.1
    """EAGLE: cross-entropy against the target's next-token distribution."""
    medusa_decay: float = 0.8
    """Medusa: head k's loss is weighted by decay**k."""

    def __post_init__(self) -> None:
        if (
            self.feature_weight < 0
            or self.token_weight < 0
            or self.feature_weight + self.token_weight == 0
        ):
            raise ValueError(
                f"EAGLE loss weights must be >= 0 and not both 0, got {self.feature_weight}, "
                f"{self.token_weight}"
            )
        if not 0 < self.medusa_decay <= 1:
            raise ValueError(f"medusa_decay must be in (0, 1], got {self.medusa_decay}")


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar to minimise."""
    parts: dict[str, torch.Tensor]
    """Named detached scalars for logging (per-head losses and accuracies)."""


def response_positions(lengths: torch.Tensor, prompt_len: torch.Tensor, width: int) -> torch.Tensor:
    """q with prompt_len - 1 <= q <= length - 2: features whose next token is a response token.
    lengths, prompt_len: # [B] -> # [B, width] bool"""
    q = torch.arange(width, device=lengths.device)[None]  # [1, width]
    return (q >= (prompt_len - 1)[:, None]) & (q <= (lengths - 2)[:, None])


def soft_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(target || draft). Both # [M, vocab]

    The cross-entropy against the target's soft labels minus the target's own entropy: the same
    gradient, but 0 at a perfect draft, so the logged value reads as distance from the target.
    """
    target_log_probs = F.log_softmax(target_logits.float(), dim=-1)
    draft_log_probs = F.log_softmax(draft_logits.float(), dim=-1)
    return F.kl_div(draft_log_probs, target_log_probs, log_target=True, reduction="batchmean")


def topk_hits(draft_logits: torch.Tensor, target_token: torch.Tensor, k: int) -> torch.Tensor:
    """Fraction of rows whose target token is among the draft's top k. # [M, vocab], [M]"""
    top = draft_logits.topk(min(k, draft_logits.shape[-1]), dim=-1).indices  # [M, k]
    return (top == target_token[:, None]).any(-1).float().mean()


def medusa_loss(
    heads: nn.Module,
    lm_head: nn.Module,
    features: torch.Tensor,  # [B, N, H] target features f_0 .. f_{N-1}
    mask: torch.Tensor,  # [B, N] bool, from response_positions
    weights: LossWeights,
) -> LossOutput:
    b_idx, q_idx = mask.nonzero(as_tuple=True)  # rows where target_probs are needed
    with torch.no_grad():
        target_logits = lm_head(features[b_idx, q_idx])  # [M, vocab]
        target_token = target_logits.argmax(-1)  # [M] the target's greedy choice
    num_heads = heads.config.num_heads
    total = features.new_zeros(())
    norm = 0.0
    parts: dict[str, torch.Tensor] = {}
    for k in range(num_heads):
        t_idx = q_idx - k - 1  # head k at t predicts x_{t+k+2}, labelled by target_probs at t+k+1
        rows = t_idx >= 0
        if not rows.any():
            continue
        drafted = heads(features[b_idx[rows], t_idx[rows]])[:, k]  # [M_k, H]
        draft_logits = lm_head(drafted)  # [M_k, vocab]
        loss_k = soft_kl(draft_logits, target_logits[rows])
        weight = weights.medusa_decay**k
        total = total + weight * loss_k
        norm += weight
        parts[f"loss_head{k}"] = loss_k.detach()
        parts[f"top1_head{k}"] = topk_hits(draft_logits.detach(), target_token[rows], 1)
        parts[f"top5_head{k}"] = topk_hits(draft_logits.detach(), target_token[rows], 5)
    return LossOutput(loss=total / max(norm, 1e-9), parts=parts)


def eagle_loss(
    head: nn.Module,
    embed: nn.Module,
    lm_head: nn.Module,
    input_ids: torch.Tensor,  # [B, L]
    features: torch.Tensor,  # [B, L-1, H] target features f_0 .. f_{L-2}
    mask: torch.Tensor,  # [B, L-1] bool, from response_positions
    weights: LossWeights,
    input_features: torch.Tensor | None = None,  # [B, L-1, H] what the head reads; None: features
) -> LossOutput:
    """Pairs j = 0 .. L-3: (embed(x_{j+1}), f_j) at position j+1 -> f_{j+1}."""
    pairs = features.shape[1] - 1
    source = features if input_features is None else input_features
    positions = torch.arange(1, pairs + 1, device=input_ids.device).expand(input_ids.shape[0], -1)
    with torch.no_grad():
        token_embeds = embed(input_ids[:, 1 : pairs + 1])  # [B, L-2, H]
    predicted = head(token_embeds, source[:, :pairs], positions)  # [B, L-2, H] ~ f_1 .. f_{L-2}
    selected = mask[:, 1:]  # output j is compared with f_{j+1}
    drafted = predicted[selected]  # [M, H]
    wanted = features[:, 1:][selected]  # [M, H]
    feature_loss = F.smooth_l1_loss(drafted.float(), wanted.float())
    with torch.no_grad():
        target_logits = lm_head(wanted)  # [M, vocab]
        target_token = target_logits.argmax(-1)
    draft_logits = lm_head(drafted)  # [M, vocab]
    token_loss = soft_kl(draft_logits, target_logits)
    loss = weights.feature_weight * feature_loss + weights.token_weight * token_loss
    parts = {
        "feature_loss": feature_loss.detach(),
        "token_loss": token_loss.detach(),
        "top1_head0": topk_hits(draft_logits.detach(), target_token, 1),
        "top5_head0": topk_hits(draft_logits.detach(), target_token, 5),
    }
    return LossOutput(loss=loss, parts=parts)
