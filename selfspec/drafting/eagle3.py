"""EAGLE-3 drafting: as EAGLE's (one head forward per depth over the tree, its own KV cache),
reading the target's fused low/mid/high states for committed tokens and drafting over its own
lm_head and draft vocabulary.

The decoding loop hands ``start`` and ``advance`` the target's states at the head's
``target_layers``, concatenated (``selfspec.drafting.taps``), instead of the last hidden state;
they are fused by the head's ``fc`` before entering its cache. Deeper in a draft the head reads
its own output, exactly as it was trained (the training-time test). The cache convention and the
tree growth are EAGLE's (``selfspec.drafting.eagle``).
"""

from __future__ import annotations

import torch

from selfspec.drafting.eagle import EagleDrafter, EagleState
from selfspec.drafting.fused_head import FusedEagle3Head
from selfspec.heads.eagle3 import Eagle3Head
from selfspec.target_forward import TargetForward


class Eagle3Projection:
    """Draft logits from the head's own norm + lm_head; draft indices map to token ids by
    ``d2t``. The same face as ``DraftProjection`` for ``grow_tree``."""

    def __init__(self, head: Eagle3Head, vocab_size: int) -> None:
        self.head = head
        self.vocab_size = vocab_size
        self.draft_vocab = head.draft_vocab  # [N] ascending token ids, or None

    @property
    def size(self) -> int:
        return int(self.head.lm_head.weight.shape[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """# [..., H] (the head's pre-norm hidden state) -> [..., N]"""
        return self.head.logits(hidden)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Draft indices -> token ids; negative indices (no draw) stay -1."""
        if self.draft_vocab is None:
            return indices
        return torch.where(indices >= 0, self.draft_vocab[indices.clamp(min=0)], indices)

    def to_full(self, probs: torch.Tensor) -> torch.Tensor:
        """# [..., N] -> [..., vocab] with zeros outside the draft vocabulary."""
        if self.draft_vocab is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.vocab_size)
        return full.index_copy_(-1, self.draft_vocab, probs)


class Eagle3Drafter(EagleDrafter):
    """``target_layers``: the target states ``start`` / ``advance`` expect, concatenated in this
    order (the generator taps them during its forwards)."""

    def __init__(self, head: Eagle3Head, target: TargetForward) -> None:
        self.head = head
        self.fused = FusedEagle3Head(head)  # its layer in one C++ call where it can
        self.target = target
        self.target_layers: tuple[int, ...] = head.config.target_layers
        self.projection = Eagle3Projection(head, target.vocab_size)  # type: ignore[assignment]
        if head.config.vocab_size != target.vocab_size:
            raise ValueError(
                f"EAGLE-3 heads for a vocabulary of {head.config.vocab_size} tokens cannot draft "
                f"for a target with {target.vocab_size}"
            )

    def start(
        self,
        prompt_features: torch.Tensor,  # [S, k*H] the prompt's states at target_layers
        prompt_tokens: torch.Tensor,  # [S]
        first_token: int,
    ) -> EagleState:
        state = EagleState(root_feature=prompt_features.new_zeros(self.head.config.hidden_size))
        first = torch.tensor([first_token], device=prompt_tokens.device)
        self._append(
            state, self.head_features(prompt_features), torch.cat([prompt_tokens[1:], first])
        )
        return state

    def head_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's states at ``target_layers`` fused by the head's ``fc``: committed pairs
        are (g_j, token_{j+1}). # [A, k*H] -> [A, H]"""
        width = len(self.target_layers) * self.head.config.hidden_size
        if features.shape[-1] != width:
            raise ValueError(
                f"EAGLE-3 heads read the target's states at layers {list(self.target_layers)} "
                f"concatenated ({width} wide), got features {features.shape[-1]} wide: the "
                "forward ran without the heads' layer taps"
            )
        return self.head.fuse(features)
