"""Draft logits: the target's lm_head, restricted to the heads' draft vocabulary if they have one.

Drafts index into the draft vocabulary; ``token_ids`` maps those indices back to the target's
token ids, and ``to_full`` spreads a draft distribution over the whole vocabulary (zero outside
the draft vocabulary), which is what rejection sampling needs as the proposal.
"""

from __future__ import annotations

import torch
from torch import nn

from selfspec.packed_linear import is_packed, pack_linears


class DraftProjection:
    """Owned by a drafter; holds its own copy of the draft rows of the lm_head (the target's
    module is never modified), packed like the lm_head (`selfspec.packed_linear`). Build it after
    the target has its final dtype and device."""

    def __init__(self, lm_head: nn.Module, draft_vocab: torch.Tensor | None) -> None:
        self.lm_head = lm_head
        self.vocab_size = int(lm_head.weight.shape[0])
        self.draft_vocab = draft_vocab  # [N] ascending token ids, or None
        self.rows: nn.Linear | None = None  # the lm_head's draft rows: H -> N
        if draft_vocab is not None:
            weight = lm_head.weight
            bias = getattr(lm_head, "bias", None)
            self.rows = nn.Linear(
                weight.shape[1],
                len(draft_vocab),
                bias=bias is not None,
                device=weight.device,
                dtype=weight.dtype,
            ).requires_grad_(False)
            with torch.no_grad():
                self.rows.weight.copy_(weight[draft_vocab])  # [N, H]
                if bias is not None:
                    self.rows.bias.copy_(bias[draft_vocab])  # [N]
            if is_packed(lm_head):
                pack_linears(self.rows)

    @property
    def size(self) -> int:
        return self.vocab_size if self.draft_vocab is None else int(self.draft_vocab.shape[0])

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """# [..., H] -> [..., N] draft logits over the draft vocabulary."""
        if self.rows is None:
            return self.lm_head(features)
        return self.rows(features)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> token ids; negative indices (no draw) stay -1."""
        if self.draft_vocab is None:
            return indices
        return torch.where(indices >= 0, self.draft_vocab[indices.clamp(min=0)], indices)

    def to_full(self, probs: torch.Tensor) -> torch.Tensor:
        """# [..., N] -> [..., vocab] with zeros outside the draft vocabulary."""
        if self.draft_vocab is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.vocab_size)
        return full.index_copy_(-1, self.draft_vocab, probs)
