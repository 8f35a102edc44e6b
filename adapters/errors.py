"""Typed adapter errors. Each names the adapter and says what was expected.

Every operation of the store either succeeds or raises one of these and leaves the store exactly
as it was (same known adapters, same resident set, same LRU order, same weights).
"""

from __future__ import annotations


class AdapterError(ValueError):
    """Base of every adapter error."""


class UnknownAdapter(AdapterError, KeyError):
    """No adapter of that name is known to the store (never a silent fallback to the base)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnsafeAdapterName(AdapterError):
    """A name with path characters, spaces, or too long (see `validate.NAME_PATTERN`)."""


class ReservedAdapterName(UnsafeAdapterName):
    """A name the store keeps for something else: the base model's own name."""


class AdapterPathError(AdapterError):
    """A path that is missing, not a directory, or escapes the configured root."""


class InvalidAdapter(AdapterError):
    """The adapter directory is not a usable plain peft LoRA adapter."""


class PickleAdapter(InvalidAdapter):
    """Weights stored as a pickle (`adapter_model.bin`): refused, loading one can run code."""


class CorruptAdapter(InvalidAdapter):
    """`adapter_model.safetensors` is truncated, malformed, or holds non-finite values."""


class IncompatibleAdapter(InvalidAdapter):
    """The adapter does not fit the loaded base (modules missing, shapes differ, wrong model)."""


class RankTooHigh(InvalidAdapter):
    """A LoRA rank above the store's limit."""


class StoreFull(AdapterError):
    """The resident set is full of pinned adapters, so nothing can be evicted for a new one."""
