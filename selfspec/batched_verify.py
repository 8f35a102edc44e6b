"""One target forward that verifies the trees of several requests, each over its own KV cache.

Requests have caches of different lengths and trees of different sizes. The forward runs on a
padded batch: row b holds request b's cache (L_b entries, padded to L = max L_b) followed by its
tree (T_b nodes, padded to T = max T_b). The 4D mask lets each tree node see its request's
cache and its own ancestors, nothing else; a padding node sees only itself (a fully masked row
would be NaN). Masked keys get exactly zero attention weight, so each row's features are the
request's own (up to floating-point summation order of the batched kernels, as in any batched
server).

Afterwards each request's cache gets its tree's KV entries appended, exactly as a forward of
its own would have done, and ``GenerationStream.conclude`` verifies and commits as usual.

Cost: stacking the caches copies them once per step (a single-request step copies its cache
once too, inside ``DynamicCache.update``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from selfspec.generation import DraftedStep, RequestState
from selfspec.target_forward import TargetForward


def verify_features(
    target: TargetForward, requests: Sequence[tuple[RequestState, DraftedStep]]
) -> list[torch.Tensor]:
    """Run the trees of ``requests`` through the target in one forward.

    Returns each request's tree features # [T_b, H]; each request's cache has its tree's KV
    entries appended (as ``TargetForward.features`` does for one request), and a request whose
    heads read tapped layers (EAGLE-3) gets their states in ``state.draft_features``."""
    if not requests:
        return []
    sizes = [drafted.tree.size for _, drafted in requests]
    lengths = [state.committed_len for state, _ in requests]
    for state, _ in requests:
        cached = state.cache.get_seq_length()
        if cached != state.committed_len:
            raise ValueError(
                f"a request's cache holds {cached} entries but {state.committed_len} are "
                "committed: its previous step was not concluded"
            )
    batch, prefix, width = len(requests), max(lengths), max(sizes)
    device, dtype = target.device, target.dtype
    with record_function("selfspec.batch_buffers"):
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)  # [B, T]
        positions = torch.zeros(batch, width, dtype=torch.long, device=device)  # [B, T]
        mask = torch.full(  # [B, 1, T, L + T]
            (batch, 1, width, prefix + width), torch.finfo(dtype).min, dtype=dtype, device=device
        )
        for row, ((_, drafted), size, length) in enumerate(
            zip(requests, sizes, lengths, strict=True)
        ):
            tree_mask = drafted.buffers.attention_mask[0, 0]  # [T_b, L_b + T_b]
            tokens[row, :size] = drafted.tree.tokens
            positions[row, :size] = drafted.buffers.position_ids[0]
            positions[row, size:] = length
            mask[row, 0, :size, :length] = tree_mask[:, :length]
            mask[row, 0, :size, prefix : prefix + size] = tree_mask[:, length:]
            padding = torch.arange(size, width, device=device)
            mask[row, 0, padding, prefix + padding] = 0.0
        stacked = _stacked_cache(target, [state.cache for state, _ in requests], prefix)
    taps = {id(state.taps): state.taps for state, _ in requests if state.taps is not None}
    with record_function("selfspec.verify_forward"), contextlib.ExitStack() as stack:
        records = {key: stack.enter_context(t.capture()) for key, t in taps.items()}
        features = target.features(tokens, positions, stacked, mask)  # [B, T, H]
    tapped = {key: record.stacked() for key, record in records.items()}  # [B, T, k * H] each
    for row, ((state, _), size) in enumerate(zip(requests, sizes, strict=True)):
        if state.taps is not None:
            state.draft_features = tapped[id(state.taps)][row, :size]  # [T_b, k * H]
    with record_function("selfspec.batch_unstack"):
        for row, ((state, _), size) in enumerate(zip(requests, sizes, strict=True)):
            for own, shared in zip(state.cache.layers, stacked.layers, strict=True):
                own.update(
                    shared.keys[row : row + 1, :, prefix : prefix + size],
                    shared.values[row : row + 1, :, prefix : prefix + size],
                )
    return [features[row, :size] for row, size in enumerate(sizes)]


def _stacked_cache(
    target: TargetForward, caches: Sequence[DynamicCache], prefix: int
) -> DynamicCache:
    """The caches as one batch, each right-padded with zeros to ``prefix`` entries."""
    stacked = target.new_cache()
    layers = [cache.layers for cache in caches]
    for index, rows in enumerate(zip(*layers, strict=True)):
        keys = _pad_and_stack([layer.keys for layer in rows], prefix)  # [B, kv_heads, L, d]
        values = _pad_and_stack([layer.values for layer in rows], prefix)
        stacked.update(keys, values, index)
    return stacked


def _pad_and_stack(tensors: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """[1, h, L_b, d] each -> [B, h, length, d]"""
    first = tensors[0]
    out = first.new_zeros(len(tensors), first.shape[1], length, first.shape[3])
    for row, tensor in enumerate(tensors):
        out[row, :, : tensor.shape[2]] = tensor[0]
    return out
