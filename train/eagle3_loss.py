"""EAGLE-3's training-time test: the head unrolled K steps on its own outputs, a token loss each.

Notation as in ``losses.py``: x_i are a row's tokens, g_i the target's states at the head's
``target_layers`` after x_i (concatenated, # [k * H]), and the target's distribution of x_{i+1}
is softmax(lm_head(f_i)) with f_i its last hidden state.

- Step 1, index j: (embed(x_{j+1}), fc(g_j)) at position j+1, attending causally over step 1:
  what the drafter computes for committed tokens. Its output h1_j gives draft logits for
  x_{j+2}, labelled by the target's distribution at j+1.
- Step s, index j: (embed(x_{j+s}), h_{s-1, j}) at position j+s, attending to step-1 entries
  0..j and to its own chain at j: a depth-s draft node, fed the head's own feature (not the
  target's, which a draft never has) with the token teacher-forced. Its output gives logits for
  x_{j+s+1}, labelled by the target's distribution at j+s.

Unlike EAGLE-1's loss there is no feature regression: EAGLE-3's head is free to use its hidden
state as it likes; only the tokens count. Step s weighs ``step_decay**(s-1)`` (0.8 as in
EAGLE-3), gradients flow through the whole chain. Labels are the target's distribution over the
draft vocabulary, renormalised (``soft``, a forward KL), or its most likely draft token
(``argmax``, cross-entropy). Positions whose data token lies outside the draft vocabulary are not
trained (the draft can never propose it); EAGLE-3 judges this by the target's argmax over the whole
vocabulary, which here would cost the full vocabulary projection the draft vocabulary saves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.heads.eagle3 import Eagle3Head
from selfspec.train.losses import LossOutput
from selfspec.train.soft_labels import SoftLabels
from selfspec.train.ttt_attention import UnrolledKV


@dataclass(frozen=True)
class TTTConfig:
    """The training-time test of EAGLE-3 heads."""

    steps: int = 7
    """Draft steps unrolled per training step (EAGLE-3 trains 7)."""
    step_decay: float = 0.8
    """Step s's loss weighs step_decay**(s-1)."""
    labels: Literal["soft", "argmax"] = "soft"
    """soft: KL from the target's distribution over the draft vocabulary; argmax: cross-entropy
    against the target's most likely draft token."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"ttt steps must be >= 1, got {self.steps}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"ttt step_decay must be in (0, 1], got {self.step_decay}")
        if self.labels not in ("soft", "argmax"):
            raise ValueError(f"ttt labels must be 'soft' or 'argmax', got {self.labels!r}")


def eagle3_unroll(
    head: Eagle3Head,
    embed: nn.Module,
    input_ids: torch.Tensor,  # [B, L]
    layer_states: torch.Tensor,  # [B, L-1, k*H] the target's states g_0 .. g_{L-2}
    steps: int,
) -> list[torch.Tensor]:
    """The head's hidden states at each unrolled step. Each # [B, W, H] with W = L-2."""
    batch, width = input_ids.shape[0], layer_states.shape[1] - 1
    cache = UnrolledKV()  # the attention of the mask below, from its structure
    ids = F.pad(input_ids, (0, steps))  # [B, L + steps], zeros past the end
    arange = torch.arange(width, device=input_ids.device)
    previous = head.fuse(layer_states[:, :width])  # [B, W, H] inputs of step 1: fc(g_j)
    outputs = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            token_embeds = embed(ids[:, step : step + width])  # [B, W, H] x_{j+step}
        positions = (arange + step).expand(batch, -1)  # [B, W]
        attend = unrolled_attend(width, step, input_ids.device)
        previous = head(token_embeds, previous, positions, attend, cache)  # [B, W, H]
        outputs.append(previous)
    return outputs


def unrolled_attend(width: int, step: int, device: torch.device) -> torch.Tensor:
    """Step ``step`` over a cache of ``step - 1`` earlier steps plus its own entries.
    # [1, 1, W, step * W] bool: causal over step 1, the diagonal of every later step."""
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(width, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * (step - 1), dim=-1)[None, None]


TargetLogits = Callable[[torch.Tensor], torch.Tensor]
"""The target's lm_head rows of the draft vocabulary: # [M, H] -> [M, N]"""


def eagle3_loss(
    head: Eagle3Head,
    embed: nn.Module,
    input_ids: torch.Tensor,  # [B, L]
    layer_states: torch.Tensor,  # [B, L-1, k*H]
    target_features: torch.Tensor,  # [B, L-1, H] the target's last hidden states f_0 .. f_{L-2}
    target_logits: TargetLogits,
    mask: torch.Tensor,  # [B, L-1] bool, from response_positions
    config: TTTConfig,
) -> LossOutput:
    """Weighted token losses of ``config.steps`` unrolled steps (see the module docstring)."""
    width = layer_states.shape[1] - 1
    # Train only where the next token is one the draft can propose.
    nxt = input_ids[:, 1 : width + 2]  # [B, L-1] x_{q+1}, the token the target's f_q predicts
    mask = mask & head.t2d[nxt]
    b_idx, q_idx = mask.nonzero(as_tuple=True)  # the positions any step is labelled by
    with torch.no_grad():
        labels = SoftLabels.from_logits(target_logits(target_features[b_idx, q_idx]))  # M rows
    row_of = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)  # [B, L-1]
    row_of[b_idx, q_idx] = torch.arange(b_idx.shape[0], device=mask.device)
    total = layer_states.new_zeros((), dtype=torch.float32)
    norm = 0.0
    parts: dict[str, torch.Tensor] = {}
    for step, hidden in enumerate(
        eagle3_unroll(head, embed, input_ids, layer_states, config.steps), 1
    ):
        valid = width + 1 - step  # outputs j < valid are labelled by the target at j + step
        if valid < 1:
            break
        selected = mask[:, step : step + valid]  # [B, valid]
        if not selected.any():
            break
        rows = row_of[:, step : step + valid][selected]  # [M_s] rows of `labels`
        draft_logits = head.logits(hidden[:, :valid][selected])  # [M_s, N]
        tokens = labels.tokens[rows]  # [M_s] the target's most likely draft tokens
        if config.labels == "soft":
            # rows ascend (row-major order of a subset): as many as labels means all of them
            loss = labels.kl(draft_logits, None if rows.shape[0] == b_idx.shape[0] else rows)
        else:
            loss = F.cross_entropy(draft_logits.float(), tokens)
        weight = config.step_decay ** (step - 1)
        total = total + weight * loss
        norm += weight
        k = step - 1
        parts[f"loss_head{k}"] = loss.detach()
        top5 = draft_logits.detach().topk(min(5, draft_logits.shape[-1]), dim=-1).indices
        hits = top5 == tokens[:, None]  # [M_s, 5]
        parts[f"top1_head{k}"] = hits[:, 0].float().mean()
        parts[f"top5_head{k}"] = hits.any(-1).float().mean()
    return LossOutput(loss=total / max(norm, 1e-9), parts=parts)
