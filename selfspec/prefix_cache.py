"""Reuse of a prompt prefix's KV entries (and drafter features) across requests.

Prompts are cut into blocks of ``block_tokens``; block i is keyed by a hash chained over every
token of blocks 0..i and by a namespace, the adapter the request runs on (KV computed under one
adapter is not valid under another, nor under the base). A prefill looks up the longest chain of
cached blocks, copies their entries into the request's fresh cache and runs the target only over
the rest (at least one token: its logits choose the first token), then stores the new full
blocks. Blocks are evicted least recently used first when the cached bytes pass ``max_bytes``.

Exact where a row's computation does not depend on which other rows share its forward, i.e.
with the row-invariant kernels (``LeanBody.fixed_order``): the suffix attends to the same keys
in the same order as in a full prefill, so logits and tokens are the same bits.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache


@dataclass(frozen=True)
class PrefixCacheConfig:
    max_bytes: int = 512 << 20
    """Bound on the cached blocks' tensors (keys, values, features)."""
    block_tokens: int = 32

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.block_tokens < 1:
            raise ValueError(
                f"need max_bytes >= 0 and block_tokens >= 1, got {self.max_bytes}, "
                f"{self.block_tokens}"
            )


@dataclass(frozen=True)
class _Block:
    keys: tuple[torch.Tensor, ...]  # per layer [1, kv_heads, block, D]
    values: tuple[torch.Tensor, ...]
    features: torch.Tensor | None  # [block, F] what the drafter reads; None: not stored
    nbytes: int


@dataclass(frozen=True)
class CachedPrefix:
    length: int
    """Prompt tokens covered (a multiple of the block size)."""
    keys: list[torch.Tensor]  # per layer [1, kv_heads, length, D]
    values: list[torch.Tensor]
    features: torch.Tensor | None  # [length, F], when asked for


@dataclass
class PrefixCacheStats:
    hits: int = 0
    """Prefills that reused at least one block."""
    misses: int = 0
    hit_tokens: int = 0
    """Prompt tokens not recomputed."""
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, config: PrefixCacheConfig = PrefixCacheConfig()) -> None:
        self.config = config
        self.stats = PrefixCacheStats()
        self._blocks: OrderedDict[tuple[str, bytes], _Block] = OrderedDict()  # oldest use first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def _chain(self, namespace: str, tokens: list[int]) -> list[tuple[str, bytes]]:
        """The key of every full block of ``tokens``."""
        block = self.config.block_tokens
        digest = hashlib.blake2b(digest_size=16)
        keys = []
        for end in range(block, len(tokens) + 1, block):
            digest.update(np.asarray(tokens[end - block : end], dtype=np.int64).tobytes())
            keys.append((namespace, digest.copy().digest()))
        return keys

    def lookup(self, namespace: str, tokens: list[int], features: bool) -> CachedPrefix | None:
        """The longest cached prefix of ``tokens`` that leaves at least one token to compute;
        with ``features``, only blocks that hold the drafter's features count."""
        found: list[_Block] = []
        with self._lock:
            chain = self._chain(namespace, tokens[:-1])
            for key in chain:
                block = self._blocks.get(key)
                if block is None or (features and block.features is None):
                    break
                found.append(block)
            self._touch(chain[: len(found)])
            if not found:
                self.stats.misses += 1
                return None
            length = len(found) * self.config.block_tokens
            self.stats.hits += 1
            self.stats.hit_tokens += length
        layers = len(found[0].keys)
        return CachedPrefix(
            length=length,
            keys=[torch.cat([b.keys[i] for b in found], dim=-2) for i in range(layers)],
            values=[torch.cat([b.values[i] for b in found], dim=-2) for i in range(layers)],
            features=torch.cat([b.features for b in found]) if features else None,
        )

    def insert(
        self,
        namespace: str,
        tokens: list[int],
        cache: DynamicCache,
        features: torch.Tensor | None,  # [len(tokens), F] or None
    ) -> None:
        """Store the full blocks of ``tokens`` not cached yet, from a cache holding (at least)
        their entries. A cached block without features gets them when they come."""
        if self.config.max_bytes == 0:
            return
        block = self.config.block_tokens
        layers = cache.layers
        with self._lock:
            chain = self._chain(namespace, tokens)
            for index, key in enumerate(chain):
                known = self._blocks.get(key)
                if known is not None and (known.features is not None or features is None):
                    continue
                span = slice(index * block, (index + 1) * block)
                keys = tuple(layer.keys[..., span, :].clone() for layer in layers)
                values = tuple(layer.values[..., span, :].clone() for layer in layers)
                stored = None if features is None else features[span].clone()
                nbytes = sum(t.nbytes for t in (*keys, *values))
                nbytes += 0 if stored is None else stored.nbytes
                if known is not None:
                    self._bytes -= known.nbytes
                    del self._blocks[key]
                self._blocks[key] = _Block(keys, values, stored, nbytes)
                self._bytes += nbytes
            self._touch(chain)
            while self._bytes > self.config.max_bytes and self._blocks:
                _, evicted = self._blocks.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.stats.evicted_blocks += 1

    def _touch(self, chain: list[tuple[str, bytes]]) -> None:
        """Mark a chain used, its first block most recently: eviction takes a chain's deepest
        blocks first (a block is useless once one before it is gone)."""
        for key in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def drop(self, namespace: str) -> None:
        """Forget every block of ``namespace`` and of its sub-namespaces (``namespace`` + NUL +
        anything): its adapter was unloaded or replaced."""
        with self._lock:
            keys = [k for k in self._blocks if k[0].split("\x00")[0] == namespace]
            for key in keys:
                self._bytes -= self._blocks.pop(key).nbytes
