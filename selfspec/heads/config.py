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
    EAGLE3 = "eagle3"
    """EAGLE-3: the target's states at a few layers fused by an fc, one decoder layer over
    [embed(token); fused feature] with its own lm_head over a draft vocabulary."""


EAGLE3_ONLY_FIELDS = ("target_layers", "num_key_value_heads")
"""Fields other kinds leave at their defaults and do not write (their config.json is unchanged)."""


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, mid and high layers (2, L//2, L-3) for a body of ``num_layers`` decoder
    layers; bodies too shallow for that (tiny test models) take (0, L//2, L-1)."""
    if num_layers < 1:
        raise ValueError(f"a target needs >= 1 decoder layer, got {num_layers}")
    if num_layers >= 6:
        return (2, num_layers // 2, num_layers - 3)
    return (0, num_layers // 2, num_layers - 1)


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
    """Medusa: residual blocks per head. EAGLE: decoder layers (1 in the papers). EAGLE-3: 1."""
    num_attention_heads: int = 8
    """EAGLE, EAGLE-3: attention heads of the decoder layer; must divide hidden_size."""
    intermediate_size: int = 0
    """EAGLE, EAGLE-3: MLP width; 0 means 4 * hidden_size rounded like Llama (8/3 * hidden)."""
    rope_theta: float = 10000.0
    """EAGLE, EAGLE-3: rotary base of its own positional encoding."""
    norm_eps: float = 1e-6
    draft_vocab_size: int = 0
    """0: the heads draft from the whole vocabulary. N > 0: they draft only from N token ids
    (the training data's most frequent tokens). Medusa and EAGLE store them as ``draft_vocab``
    and project onto N rows of the target's lm_head; EAGLE-3 has its own lm_head of N rows and
    stores the ids as ``d2t`` / ``t2d``. Verification still uses the target's full vocabulary:
    output is unchanged, only drafting gets cheaper."""
    target_layers: tuple[int, ...] = ()
    """EAGLE-3: which of the target's hidden states it fuses, in order (low, mid, high), as
    indices of HF's ``output_hidden_states``: k is the residual stream entering decoder layer k
    (0: the token embeddings), the convention of EAGLE-3, SpecForge and vLLM. Empty otherwise."""
    num_key_value_heads: int = 0
    """EAGLE-3: key/value heads of its attention (grouped queries); 0 means num_attention_heads."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", HeadKind(self.kind))
        object.__setattr__(self, "target_layers", tuple(int(k) for k in self.target_layers))
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers", "num_attention_heads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"heads config {name} must be >= 1, got {getattr(self, name)}")
        if self.kind is not HeadKind.MEDUSA and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{self.kind.value} num_attention_heads={self.num_attention_heads} must divide "
                f"hidden_size={self.hidden_size}"
            )
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [0, vocab_size={self.vocab_size}], "
                f"got {self.draft_vocab_size}"
            )
        if self.intermediate_size < 0:
            raise ValueError(f"intermediate_size must be >= 0, got {self.intermediate_size}")
        if self.kind is HeadKind.EAGLE3:
            self._check_eagle3()
        elif self.target_layers or self.num_key_value_heads:
            raise ValueError(
                f"{self.kind.value} heads read the target's last hidden state only; "
                f"target_layers / num_key_value_heads are EAGLE-3 fields"
            )

    def _check_eagle3(self) -> None:
        if not self.target_layers or min(self.target_layers) < 0:
            raise ValueError(
                f"EAGLE-3 target_layers must be one or more layer indices >= 0, "
                f"got {list(self.target_layers)}"
            )
        if self.num_layers != 1:
            raise ValueError(
                f"EAGLE-3 heads have one decoder layer, got num_layers={self.num_layers}"
            )
        if self.num_key_value_heads < 0 or self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"EAGLE-3 num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )

    @property
    def mlp_size(self) -> int:
        return self.intermediate_size or int(8 * self.hidden_size / 3 + 63) // 64 * 64

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the EAGLE-3 attention."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def draft_rows(self) -> int:
        """Tokens the heads draft from: the draft vocabulary's size, or the whole vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        data["target_layers"] = list(self.target_layers)
        if self.kind is not HeadKind.EAGLE3:
            for name in EAGLE3_ONLY_FIELDS:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadsConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown heads config fields: {sorted(unknown)}")
        return cls(**data)
