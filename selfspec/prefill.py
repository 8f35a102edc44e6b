"""A prompt's prefill in progress, so that a server can run it in chunks between decoding rounds.

A long prompt prefilled in one forward stalls every other running request for as long as it
takes (a 1,000-token prompt: seconds on a CPU). Chunked, each round runs at most a budget of
prompt tokens (``SpeculativeGenerator.prefill_chunk``): chunk j's tokens attend to the cache of
the chunks before it and causally among themselves. On the row-invariant kernels every row is
computed exactly as in a single forward, so chunking changes no bit of the output; elsewhere
(torch's ops) the generator prefills the rest in one forward instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from selfspec.drafting.taps import LayerTaps
from selfspec.prefix_cache import CachedPrefix


@dataclass
class PrefillProgress:
    """What a prefill has done so far; ``SpeculativeGenerator.begin_prefill`` makes it."""

    prompt: torch.Tensor  # [S]
    cache: DynamicCache
    """The prompt's KV entries so far: ``done`` of them (a reused prefix's first)."""
    generator: torch.Generator
    taps: LayerTaps | None
    reuse: CachedPrefix | None
    """The prompt's longest cached prefix, copied into ``cache`` before the first chunk."""
    done: int
    """Prompt tokens in ``cache``."""
    features: list[torch.Tensor] = field(default_factory=list)
    """Each chunk's last hidden states # [n_j, H]."""
    tapped: list[torch.Tensor] = field(default_factory=list)
    """With taps: each chunk's tapped layer states # [n_j, k * H]."""

    @property
    def remaining(self) -> int:
        return int(self.prompt.shape[0]) - self.done
