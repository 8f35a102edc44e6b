"""Base-model fingerprints: what heads and adapters record about the base they were made for.

A fingerprint names the architecture, the sizes, and a hash of the token embedding and lm_head
weights, which heads use directly. Loading refuses a base whose fingerprint differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

_HASH_ROWS = 4096  # rows hashed at a time, so a large vocabulary needs no full-size copy


@dataclass(frozen=True)
class BaseFingerprint:
    """Identity of a base causal LM, as far as heads and adapters depend on it."""

    architecture: str
    """HF architecture name, e.g. "LlamaForCausalLM"."""
    hidden_size: int
    """Width of the token embedding (and of the last hidden state)."""
    vocab_size: int
    """Rows of the token embedding."""
    num_layers: int
    """Decoder layers of the base."""
    weights_hash: str
    """16 hex digits of a sha256 over the embedding and lm_head weights (see `_weights_hash`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture:
            raise ValueError(f"architecture must be a non-empty string, got {self.architecture!r}")
        for name in ("hidden_size", "vocab_size", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.weights_hash, str) or not self.weights_hash:
            raise ValueError(f"weights_hash must be a non-empty string, got {self.weights_hash!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for a checkpoint's config.json."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BaseFingerprint:
        """Inverse of `to_dict`; a missing or unknown key is an error naming it."""
        names = {f.name for f in fields(cls)}
        missing, unknown = names - data.keys(), data.keys() - names
        if missing or unknown:
            raise ValueError(
                f"base fingerprint needs exactly the keys {sorted(names)}; "
                f"missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        return cls(**data)

    def describe(self) -> str:
        """One line naming every field."""
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


class FingerprintMismatch(ValueError):
    """Heads or an adapter were made for a different base than the one loaded."""


def fingerprint_of(model: nn.Module) -> BaseFingerprint:
    """Fingerprint of a HF causal LM; a peft model is fingerprinted by its base model."""
    # Duck-typed unwrap so this module never imports peft.
    if callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    config = model.config
    architectures = getattr(config, "architectures", None)
    architecture = architectures[0] if architectures else type(model).__name__
    num_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if num_layers is None:
        raise ValueError(
            f"{architecture}: config has neither num_hidden_layers nor n_layer, so its layer "
            "count is unknown"
        )
    embedding = model.get_input_embeddings().weight  # [vocab, hidden]
    output = model.get_output_embeddings()
    if output is None:
        raise ValueError(
            f"{architecture} has no lm_head (output embeddings); a causal LM is needed"
        )
    return BaseFingerprint(
        architecture=architecture,
        hidden_size=int(embedding.shape[1]),
        vocab_size=int(embedding.shape[0]),
        num_layers=int(num_layers),
        weights_hash=_weights_hash(embedding, output.weight),  # lm_head: [vocab, hidden]
    )


def check_compatible(expected: BaseFingerprint, actual: BaseFingerprint, what: str) -> None:
    """Raise `FingerprintMismatch` unless `actual` is the base `what` was made for."""
    if expected == actual:
        return
    diffs = [
        f"{f.name}: expected {getattr(expected, f.name)!r}, got {getattr(actual, f.name)!r}"
        for f in fields(BaseFingerprint)
        if getattr(expected, f.name) != getattr(actual, f.name)
    ]
    raise FingerprintMismatch(
        f"{what} was made for base ({expected.describe()}) but the loaded base is "
        f"({actual.describe()}); differs in {'; '.join(diffs)}"
    )


@torch.no_grad()
def _weights_hash(*weights: torch.Tensor) -> str:
    """sha256 over weights rounded to bfloat16, first 16 hex digits.

    Why bfloat16: it is the coarsest dtype a target is loaded in. Rounding fp32 to bf16 is
    deterministic (round to nearest even) and bf16 to bf16 is exact, so the same checkpoint loaded
    in float32 or in bfloat16 hashes the same, while any real change of weights still shows.
    """
    digest = hashlib.sha256()
    for weight in weights:
        digest.update(str(tuple(weight.shape)).encode())
        for rows in weight.detach().split(_HASH_ROWS):
            # numpy has no bfloat16: hash the raw 16-bit patterns.
            bits = rows.to("cpu", torch.bfloat16).contiguous().view(torch.int16)
            digest.update(bits.numpy().tobytes())
    return digest.hexdigest()[:16]
