"""Draft logits: the target's lm_head, restricted to the heads' draft vocabulary if they have one.

Drafts index into the draft vocabulary; ``token_ids`` maps those indices back to the target's
token ids, and ``to_full`` spreads a draft distribution over the whole vocabulary (zero outside
the draft vocabulary), which is what rejection sampling needs as the proposal.

While a draft delta with its own vocabulary is active on the heads (an adapter whose frequent
tokens differ from the base's, ``selfspec.heads.delta``), that vocabulary replaces the heads'
for the call: on the kernels the lm_head's rows are read in place (``ops.linear_rows``), so a
thousand adapters' vocabularies cost their token ids, not a copy of rows each.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from selfspec.heads.delta import active_draft_vocab
from selfspec.kernels import extension, ops
from selfspec.kernels.modules import KernelLinear
from selfspec.packed_linear import is_packed, pack_linears


class DraftProjection:
    """Owned by a drafter; holds its own copy of the draft rows of the lm_head (the target's
    module is never modified), packed like the lm_head (`selfspec.packed_linear`). Build it after
    the target has its final dtype and device."""

    def __init__(
        self, lm_head: nn.Module, draft_vocab: torch.Tensor | None, heads: nn.Module | None = None
    ) -> None:
        """``heads``: whose active draft delta may bring its own vocabulary (None: never)."""
        self.lm_head = lm_head
        self.heads = heads
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
        vocab = self._vocab()
        return self.vocab_size if vocab is None else int(vocab.shape[0])

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """# [..., H] -> [..., N] draft logits over the draft vocabulary."""
        own = None if self.heads is None else active_draft_vocab(self.heads)
        if own is not None:
            return self._rows_of(features, own)
        if self.rows is None:
            return self.lm_head(features)
        return self.rows(features)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> token ids; negative indices (no draw) stay -1."""
        vocab = self._vocab()
        if vocab is None:
            return indices
        return torch.where(indices >= 0, vocab[indices.clamp(min=0)], indices)

    def to_full(self, probs: torch.Tensor) -> torch.Tensor:
        """# [..., N] -> [..., vocab] with zeros outside the draft vocabulary."""
        vocab = self._vocab()
        if vocab is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.vocab_size)
        return full.index_copy_(-1, vocab, probs)

    def _vocab(self) -> torch.Tensor | None:
        """The vocabulary drafts come from now: the active delta's own, or the heads'."""
        own = None if self.heads is None else active_draft_vocab(self.heads)
        return self.draft_vocab if own is None else own

    def _rows_of(self, features: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
        """Logits over ``vocab`` # [N] straight from the lm_head. # [..., H] -> [..., N]"""
        lm_head = self.lm_head
        bias = getattr(lm_head, "bias", None)
        if (
            isinstance(lm_head, KernelLinear)
            and extension.load() is not None
            and features.device.type == "cpu"
        ):
            x = features.float().contiguous()
            out = ops.linear_rows(x, lm_head.kernel_weight(), vocab)
            out = out if bias is None else out + bias.float()[vocab]
            return out.to(features.dtype)
        weight = lm_head.weight[vocab]  # [N, H]
        return F.linear(features, weight, None if bias is None else bias[vocab])
