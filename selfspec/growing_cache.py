"""A KV cache whose layers grow in place: appending S entries writes S entries.

transformers' ``DynamicLayer`` appends with ``torch.cat``: every decoding step copies the
layer's whole cache into a fresh tensor. With a 1,000-token prompt on SmolLM2-135M that is
30 layers x 2 x 768 KB, ~46 MB copied and freshly allocated per step, for one new token. A
``GrowingLayer`` keeps its keys and values in buffers with spare capacity (doubling when full)
and exposes ``keys`` / ``values`` as views of the filled prefix: a step writes only its own
entries; cropping (rejected tree nodes) just shortens the view.

Readers see what they saw before: ``keys`` is ``[B, kv_heads, length, D]``, a view with
the buffer's strides (each key row of D contiguous; the kernels' attention and SDPA read it
in place). In-place writes into the view (``selfspec.kv_commit``) land in the buffer.
Assigning ``keys`` / ``values`` (transformers' crop and batch operations do) shortens the view
when the tensor is a prefix of the buffer, otherwise adopts the tensor as the new buffer. A
view handed out before a crop may see later entries overwritten: nothing in selfspec keeps
one across steps (the prefix cache clones what it stores).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 64


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into buffers with spare capacity."""

    def __init__(self, **kwargs) -> None:
        self._key_buffer: torch.Tensor | None = None  # [B, kv_heads, capacity, D]
        self._value_buffer: torch.Tensor | None = None
        self._key_length = self._value_length = 0  # assigned one after the other (crop)
        super().__init__(**kwargs)

    @property
    def keys(self) -> torch.Tensor | None:  # [B, kv_heads, length, D]
        buffer = self._key_buffer
        return None if buffer is None else buffer[:, :, : self._key_length]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._key_buffer, self._key_length = _adopt(self._key_buffer, tensor)

    @property
    def values(self) -> torch.Tensor | None:  # [B, kv_heads, length, D]
        buffer = self._value_buffer
        return None if buffer is None else buffer[:, :, : self._value_length]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._value_buffer, self._value_length = _adopt(self._value_buffer, tensor)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states`` / ``value_states`` # [B, kv_heads, S, D]; returns the layer's
        keys and values, # [B, kv_heads, length + S, D]."""
        key_buffer, value_buffer, start = self.reserve(key_states, value_states)
        end = start + key_states.shape[-2]
        key_buffer[:, :, start:end] = key_states
        value_buffer[:, :, start:end] = value_states
        self.extend(key_states.shape[-2])
        return self.keys, self.values

    def reserve(
        self, key_like: torch.Tensor, value_like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for S more entries, as ``key_like`` / ``value_like`` # [B, kv_heads, S, D] (only
        their shapes, dtypes and device are read): (key buffer, value buffer, start), buffers
        # [B, kv_heads, capacity >= start + S, D]. The caller writes entries [start, start + S)
        in place, then calls ``extend(S)``."""
        if not self.is_initialized:
            self.lazy_initialization(key_like, value_like)
            self._key_buffer = self._value_buffer = None
            self._key_length = self._value_length = 0
        start = self._key_length
        if self._value_length != start:
            raise ValueError(f"the cache holds {start} keys but {self._value_length} values")
        end = start + key_like.shape[-2]
        if self._key_buffer is None or self._key_buffer.shape[0] != key_like.shape[0]:
            if start:
                raise ValueError("the batch size of a growing cache cannot change mid-sequence")
            self._key_buffer = buffer_like(key_like, max(MIN_CAPACITY, end))
            self._value_buffer = buffer_like(value_like, max(MIN_CAPACITY, end))
        elif end > min(self._key_buffer.shape[-2], self._value_buffer.shape[-2]):
            capacity = max(2 * self._key_buffer.shape[-2], end)
            self._key_buffer = grown_buffer(self._key_buffer, start, capacity)
            self._value_buffer = grown_buffer(self._value_buffer, start, capacity)
        return self._key_buffer, self._value_buffer, start

    def extend(self, new: int) -> None:
        """Count ``new`` more entries, written in place after ``reserve``."""
        self._key_length = self._value_length = self._key_length + new

    def keep(self, start: int, source: torch.Tensor | None, count: int) -> None:
        """Keep the first ``start`` entries, then ``count`` more: entries ``source`` # [count]
        (ascending, >= start) moved into place, or (None) the next ``count`` as they are; drop
        the rest (a verified tree's rejected nodes). What ``crop`` after an index copy does,
        without transformers' per-call bookkeeping (a step does this for every layer)."""
        if source is not None:
            keep = slice(start, start + count)
            for buffer, length in (
                (self._key_buffer, self._key_length),
                (self._value_buffer, self._value_length),
            ):
                filled = buffer[:, :, :length]
                filled[:, :, keep] = filled.index_select(-2, source)
        self._key_length = self._value_length = start + count

    def get_seq_length(self) -> int:
        return self._key_length if self.is_initialized else 0


def is_full_attention(layer) -> bool:
    """Whether a cache layer is a plain full-attention layer (growing or transformers' own),
    the kind selfspec commits trees and reuses prefixes in."""
    return type(layer) in (DynamicLayer, GrowingLayer)


def growing_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose layers are ``GrowingLayer``s (full attention)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def supports_growing(config) -> bool:
    """Whether every layer of ``config`` is full attention (sliding windows keep their own)."""
    cache = DynamicCache(config=config)
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


def buffer_like(states: torch.Tensor, capacity: int) -> torch.Tensor:
    """An empty buffer for ``capacity`` entries shaped as ``states`` # [B, h, n, D]."""
    batch, heads, _, dim = states.shape
    return states.new_empty(batch, heads, capacity, dim)


def grown_buffer(buffer: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    """``buffer`` # [B, h, c, D] moved into one of ``capacity`` entries, its first ``length``
    kept."""
    out = buffer_like(buffer, capacity)
    out[:, :, :length] = buffer[:, :, :length]
    return out


def _adopt(
    buffer: torch.Tensor | None, tensor: torch.Tensor | None
) -> tuple[torch.Tensor | None, int]:
    """(buffer, length) after assigning ``tensor`` # [B, h, n, D]: a prefix view of ``buffer``
    shortens it; anything else (an empty tensor included) becomes the buffer."""
    if tensor is None:
        return None, 0
    if tensor.dim() != 4:  # transformers' lazy initialization assigns empty 1-D tensors
        return None, 0
    if (
        buffer is not None
        and tensor.data_ptr() == buffer.data_ptr()
        and tensor.stride() == buffer.stride()
        and tensor.shape[:2] == buffer.shape[:2]
        and tensor.shape[-1] == buffer.shape[-1]
        and tensor.shape[-2] <= buffer.shape[-2]
    ):
        return buffer, int(tensor.shape[-2])
    return tensor, int(tensor.shape[-2])
