"""Draft logits: the target's lm_head, restricted to the heads' draft vocabulary if they have one.

Drafts index into the draft vocabulary; ``token_ids`` maps those indices back to the target's
token ids, and ``to_full`` spreads a draft distribution over the whole vocabulary (zero outside
the draft vocabulary), which is what rejection sampling needs as the proposal.
"""

from __future__ import annotations

import torch
from torch import nn


class DraftProjection:
    """Owned by a drafter; holds its own copy of the draft rows of the lm_head (the target's
    module is never modified). Build it after the target has its final dtype and device."""

    def __init__(self, lm_head: nn.Module, draft_vocab: torch.Tensor | None) -> None:
        self.lm_head = lm_head
        self.vocab_size = int(lm_head.weight.shape[0])
        self.draft_vocab = draft_vocab  # [N] ascending token ids, or None
        if draft_vocab is None:
            self.weight = self.bias = None
        else:
            with torch.no_grad():
                self.weight = lm_head.weight[draft_vocab].detach().clone()  # [N, H]
                bias = getattr(lm_head, "bias", None)
                self.bias = None if bias is None else bias[draft_vocab].detach().clone()  # [N]

    @property
    def size(self) -> int:
        return self.vocab_size if self.draft_vocab is None else int(self.draft_vocab.shape[0])

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """# [..., H] -> [..., N] draft logits over the draft vocabulary."""
        if self.weight is None:
            return self.lm_head(features)
        return nn.functional.linear(features, self.weight.to(features.dtype), self.bias)

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
