"""Typed, frozen configuration of draft heads, stored in the checkpoint's config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class HeadKind(str, Enum):
    MEDUSA = "medusa"
    """K residual blocks on the target's last feature; head k predicts token t+k+2."""
    EAGLE = "eagle"
    """One decoder layer over [embed(token); feature] predicting the next feature."""


@dataclass(frozen=True)
class HeadsConfig:
    """Shape of a set of draft heads. Sizes must match the target they are attached to."""

    kind: HeadKind
    hidden_size: int
    """The target's hidden size (width of its lm_head input)."""
    vocab_size: int
    """The target's vocabulary size (rows of its lm_head)."""
    num_heads: int = 4
    """Medusa: number of heads, i.e. the deepest draft depth. Ignored by EAGLE."""
    num_layers: int = 1
    """Medusa: residual blocks per head. EAGLE: decoder layers (1 in the papers)."""
    num_attention_heads: int = 8
    """EAGLE: attention heads of its decoder layer; must divide hidden_size."""
    intermediate_size: int = 0
    """EAGLE: MLP width; 0 means 4 * hidden_size rounded like Llama (8/3 * hidden)."""
    rope_theta: float = 10000.0
    """EAGLE: rotary base of its own positional encoding."""
    norm_eps: float = 1e-6
    draft_vocab_size: int = 0
    """0: the heads draft from the whole vocabulary. N > 0: they draft only from N token ids,
    stored with the weights as ``draft_vocab`` (the training data's most frequent tokens), so
    each draft depth projects onto N rows of the lm_head instead of all of them. Verification
    still uses the target's full vocabulary: output is unchanged, only drafting gets cheaper."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", HeadKind(self.kind))
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers", "num_attention_heads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"heads config {name} must be >= 1, got {getattr(self, name)}")
        if self.kind is HeadKind.EAGLE and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"EAGLE num_attention_heads={self.num_attention_heads} must divide "
                f"hidden_size={self.hidden_size}"
            )
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [0, vocab_size={self.vocab_size}], "
                f"got {self.draft_vocab_size}"
            )
        if self.intermediate_size < 0:
            raise ValueError(f"intermediate_size must be >= 0, got {self.intermediate_size}")

    @property
    def mlp_size(self) -> int:
        return self.intermediate_size or int(8 * self.hidden_size / 3 + 63) // 64 * 64

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadsConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown heads config fields: {sorted(unknown)}")
        return cls(**data)
