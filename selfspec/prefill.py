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
from torch.profiler import record_function
from transformers import DynamicCache

from selfspec.drafting.taps import LayerTaps, maybe_capture
from selfspec.prefix_cache import CachedPrefix
from selfspec.target_forward import TargetForward


@dataclass(frozen=True)
class PrefillChunk:
    """The prompt tokens one chunk runs: ``SpeculativeGenerator.next_prefill_chunk`` makes it,
    a forward of its own or one shared with other requests runs it (over the prefill's cache),
    ``absorb_prefill_chunk`` takes the results."""

    tokens: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    mask: torch.Tensor | None
    """# [1, 1, n, end] additive: the cached prompt all visible, causal among themselves; None
    for the first chunk over an empty cache (causal)."""
    end: int
    """Prompt tokens in the cache once the chunk has run."""


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


def run_prefill_chunk(
    target: TargetForward, progress: PrefillProgress, chunk: PrefillChunk
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``chunk`` in a forward of its own over the prefill's cache: its last hidden states
    # [n, H] and, with taps, its tapped layer states # [n, k * H]."""
    with record_function("selfspec.prefill"), maybe_capture(progress.taps) as tapped:
        features = target.features(
            chunk.tokens[None], chunk.positions[None], progress.cache, chunk.mask
        )
    return features[0], None if tapped is None else tapped.stacked()[0]
