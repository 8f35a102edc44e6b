"""The target's KV cache after verification: keep the accepted path's entries, or drop a tree's."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from selfspec.growing_cache import GrowingLayer, is_full_attention


def commit_accepted(cache: DynamicCache, committed_len: int, accepted: torch.Tensor) -> None:
    """Drop rejected tree entries, moving the accepted ones (in path order) right after the prefix.

    The cache holds ``committed_len`` entries followed by one entry per tree node.
    accepted: # [A] tree node indices, ascending (root first).
    """
    num_accepted = int(accepted.shape[0])
    # Fast path: the accepted nodes are exactly the first A tree nodes (e.g. a chain).
    contiguous = bool((accepted == torch.arange(num_accepted, device=accepted.device)).all())
    source = None if contiguous else accepted + committed_len  # [A]
    for layer in cache.layers:
        if type(layer) is GrowingLayer:
            layer.keep(committed_len, source, num_accepted)
            continue
        if not is_full_attention(layer):
            raise TypeError(
                f"selfspec needs a plain DynamicCache; layer type {type(layer).__name__} "
                "(sliding window / linear attention) is not supported yet"
            )
        tree_len = layer.keys.shape[-2] - committed_len
        if source is not None:
            keep = slice(committed_len, committed_len + num_accepted)
            layer.keys[..., keep, :] = layer.keys.index_select(-2, source)
            layer.values[..., keep, :] = layer.values.index_select(-2, source)
        layer.crop(num_accepted - tree_len)  # negative: tokens to remove from the end


def drop_uncommitted(cache: DynamicCache, committed_len: int) -> None:
    """Remove every entry past the first ``committed_len``, layer by layer (a forward that failed
    midway may have extended only some layers), so the step can be verified again."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - committed_len
        if extra > 0:
            layer.crop(-extra)  # negative: entries to remove from the end
