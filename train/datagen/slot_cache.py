"""A KV cache of fixed slots for continuous batching: rows join and leave between steps.

Layout per layer: keys and values # [slots, kv_heads, capacity, D]. Every forward appends at the
same column ``end`` for all the rows it runs, so each slot's entries stay contiguous and end at
``end`` ("right-aligned"): a row of n cached tokens owns columns [end - n, end). A joining
prompt's entries are written into its slot at [end - p, end) (``place``); a leaving row just
stops being run. When ``end`` reaches the capacity the columns nobody needs any more are dropped
(``compact``: one copy of the live window to the left).

``LeanBody`` drives it through ``update`` like a transformers ``Cache``: before a forward the
decoder says how many slots run (``begin``: its live rows are kept in slots 0..A-1, ``move``),
the body writes each layer's new entries and reads the window the mask covers, a view of the
buffers; after it, ``advance`` moves ``end``.

``masked_reads`` (the kernels' attention, which never reads a masked key): the buffers are left
uninitialised, so memory is touched only where entries are written. Otherwise (SDPA, where a
masked key's value is still multiplied by its zero weight) they are zeroed, never NaN.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class SlotCache:
    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        reserve: int,
        masked_reads: bool = False,
    ) -> None:
        """``reserve``: columns kept free on the left of ``end`` for a joining prompt (the
        longest prompt); ``capacity`` must leave room for the longest row after it."""
        if capacity <= reserve:
            raise ValueError(f"SlotCache capacity {capacity} must exceed its reserve {reserve}")
        shape = (slots, kv_heads, capacity, head_dim)
        new = torch.empty if masked_reads else torch.zeros
        self.keys = [new(shape, dtype=dtype) for _ in range(layers)]
        self.values = [new(shape, dtype=dtype) for _ in range(layers)]
        self.capacity, self.reserve = capacity, reserve
        self.end = reserve  # the column the next forward writes
        self.lengths = torch.zeros(slots, dtype=torch.long)  # cached tokens per slot
        self._count = 0  # slots the running forward runs: 0..count-1
        self._start = 0  # first column it reads

    def get_seq_length(self, layer: int = 0) -> int:
        return self.end

    def reset(self) -> None:
        """Empty every slot (the buffers are kept: allocating them is the expensive part)."""
        self.end = self.reserve
        self.lengths.zero_()

    def free_columns(self) -> int:
        return self.capacity - self.end

    def place(self, slot: int, prompt_cache: DynamicCache) -> None:
        """Write a prompt's entries (batch 1, p tokens) into ``slot`` ending at ``end``."""
        length = prompt_cache.get_seq_length()
        if length > self.end:
            raise ValueError(f"a prompt of {length} tokens does not fit the reserve {self.end}")
        for index, layer in enumerate(prompt_cache.layers):
            self.keys[index][slot, :, self.end - length : self.end] = layer.keys[0]
            self.values[index][slot, :, self.end - length : self.end] = layer.values[0]
        self.lengths[slot] = length

    def move(self, source: int, target: int) -> None:
        """Move slot ``source``'s entries to slot ``target`` (which becomes free: ``source``)."""
        length = int(self.lengths[source])
        columns = slice(self.end - length, self.end)
        for tensors in (self.keys, self.values):
            for buffer in tensors:
                buffer[target, :, columns] = buffer[source, :, columns]
        self.lengths[target] = length
        self.lengths[source] = 0

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0

    def begin(self, count: int) -> torch.Tensor:
        """The next forward runs slots 0..count-1 (the decoder keeps its live rows there);
        returns its additive attention mask over the window it reads # [A, 1, 1, window]
        float32 (0 where allowed, the most negative float where not)."""
        lengths = self.lengths[:count]
        self._count, self._start = count, self.end - int(lengths.max())
        columns = torch.arange(self._start, self.end + 1)  # [window]
        allowed = columns[None] >= (self.end - lengths)[:, None]  # [A, window]
        mask = torch.zeros(allowed.shape, dtype=torch.float32)
        mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
        return mask[:, None, None]

    def positions(self, count: int) -> torch.Tensor:
        """Position of each running row's next token. # [A, 1]"""
        return self.lengths[:count, None].clone()

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int):
        """key, value: # [A, kv_heads, 1, D] -> the window # [A, kv_heads, window, D] each, a
        view of the buffers (the kernels' attention reads it in place)."""
        rows, window = slice(0, self._count), slice(self._start, self.end + 1)
        keys, values = self.keys[layer], self.values[layer]
        keys[rows, :, self.end] = key[:, :, 0]
        values[rows, :, self.end] = value[:, :, 0]
        return keys[rows, :, window], values[rows, :, window]

    def advance(self) -> None:
        """The forward is done: its rows hold one more token each."""
        self.lengths[: self._count] += 1
        self.end += 1
        self._count = 0

    def compact(self) -> None:
        """Drop the columns no slot needs, keeping ``reserve`` free on the left."""
        longest = int(self.lengths.max())
        keep = max(longest, self.reserve)
        shift = self.end - keep
        if shift <= 0:
            return
        for tensors in (self.keys, self.values):
            for buffer in tensors:
                buffer[:, :, :keep] = buffer[:, :, shift : self.end].clone()
        self.end = keep
