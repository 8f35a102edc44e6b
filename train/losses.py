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

``lm_head`` may be restricted to a loss vocabulary (the most frequent tokens of the training data,
as EAGLE-3 does for its draft vocabulary): both distributions are then renormalised over it, which
on a CPU cuts the dominant cost (the vocabulary projections) several times over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.heads.eagle import EagleCache, EagleHead

Projection = Callable[[torch.Tensor], torch.Tensor]
"""The target's lm_head, or its rows of the loss vocabulary: # [..., H] -> [..., vocab]"""


@dataclass(frozen=True)
class LossWeights:
    """Weights of the loss terms."""

    feature_weight: float = 1.0
    """EAGLE: smooth-L1 regression of the next feature."""
    token_weight: float = 0.1
    """EAGLE: cross-entropy against the target's next-token distribution."""
    depth_decay: float = 0.8
    """Medusa head k's loss, and EAGLE's loss at simulated draft depth k+1, weigh decay**k."""

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
        if not 0 < self.depth_decay <= 1:
            raise ValueError(f"depth_decay must be in (0, 1], got {self.depth_decay}")


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
    lm_head: Projection,
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
        weight = weights.depth_decay**k
        total = total + weight * loss_k
        norm += weight
        parts[f"loss_head{k}"] = loss_k.detach()
        parts[f"top1_head{k}"] = topk_hits(draft_logits.detach(), target_token[rows], 1)
        parts[f"top5_head{k}"] = topk_hits(draft_logits.detach(), target_token[rows], 5)
    return LossOutput(loss=total / max(norm, 1e-9), parts=parts)


def eagle_unroll(
    head: EagleHead,
    embed: nn.Module,
    input_ids: torch.Tensor,  # [B, L]
    features: torch.Tensor,  # [B, L-1, H] target features f_0 .. f_{L-2}
    depth: int,
) -> list[torch.Tensor]:
    """The head's outputs at ``depth`` simulated draft steps (EAGLE-3's "training-time test").

    Step 1, index j: (embed(x_{j+1}), f_j) at position j+1, attending to step-1 entries 0..j:
    the head reading the target's own features. Step s, index j: (embed(x_{j+s}), the step s-1
    output at j) at position j+s, attending to step-1 entries 0..j and to its own chain at j (one
    entry per earlier step): what a depth-s draft node sees at inference, with the token
    teacher-forced. Step s's output at j should be f_{j+s}. Each # [B, W, H] with W = L-2.
    """
    batch, width = input_ids.shape[0], features.shape[1] - 1
    cache = EagleCache()
    ids = F.pad(input_ids, (0, depth))  # [B, L + depth], zeros past the end
    arange = torch.arange(width, device=input_ids.device)
    previous = features[:, :width]  # inputs of step 1: f_0 .. f_{L-3}
    outputs = []
    for step in range(1, depth + 1):
        with torch.no_grad():
            token_embeds = embed(ids[:, step : step + width])  # [B, W, H] x_{j+step}
        positions = (arange + step).expand(batch, -1)  # [B, W]
        attend = _unrolled_attend(width, step, input_ids.device)
        previous = head(token_embeds, previous, positions, attend, cache)  # [B, W, H]
        outputs.append(previous)
    return outputs


def _unrolled_attend(width: int, step: int, device: torch.device) -> torch.Tensor:
    """Step ``step`` over a cache of ``step - 1`` earlier steps plus its own entries.
    # [1, 1, W, step * W] bool: causal over step 1, the diagonal of every later step."""
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(width, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * (step - 1), dim=-1)[None, None]


def eagle_loss(
    head: EagleHead,
    embed: nn.Module,
    lm_head: Projection,
    input_ids: torch.Tensor,  # [B, L]
    features: torch.Tensor,  # [B, L-1, H] target features f_0 .. f_{L-2}
    mask: torch.Tensor,  # [B, L-1] bool, from response_positions
    weights: LossWeights,
    depth: int = 1,
) -> LossOutput:
    """Feature regression + token KL at each simulated draft step (see `eagle_unroll`).

    Step s weighs depth_decay**(s-1); gradients flow through the chain of steps, as in EAGLE-3.
    """
    width = features.shape[1] - 1
    total = features.new_zeros(())
    norm = 0.0
    parts: dict[str, torch.Tensor] = {}
    for step, predicted in enumerate(eagle_unroll(head, embed, input_ids, features, depth), 1):
        valid = width + 1 - step  # outputs j < valid have a target f_{j+step}
        selected = mask[:, step:]  # [B, valid] output j is compared with f_{j+step}
        if valid < 1 or not selected.any():
            break
        drafted = predicted[:, :valid][selected]  # [M, H]
        wanted = features[:, step:][selected]  # [M, H]
        feature_loss = F.smooth_l1_loss(drafted.float(), wanted.float())
        with torch.no_grad():
            target_logits = lm_head(wanted)  # [M, vocab]
            target_token = target_logits.argmax(-1)
        draft_logits = lm_head(drafted)  # [M, vocab]
        token_loss = soft_kl(draft_logits, target_logits)
        weight = weights.depth_decay ** (step - 1)
        term = weights.feature_weight * feature_loss + weights.token_weight * token_loss
        total = total + weight * term
        norm += weight
        k = step - 1
        parts[f"feature_loss_head{k}"] = feature_loss.detach()
        parts[f"token_loss_head{k}"] = token_loss.detach()
        parts[f"top1_head{k}"] = topk_hits(draft_logits.detach(), target_token, 1)
        parts[f"top5_head{k}"] = topk_hits(draft_logits.detach(), target_token, 5)
    return LossOutput(loss=total / max(norm, 1e-9), parts=parts)
