"""One target forward that verifies the trees of several requests, each over its own KV cache.

Requests have caches of different lengths and trees of different sizes. On the kernels'
whole-body path (``LeanBody.rows_forward``) the trees run back to back, none padded (the
linear layers take every node at once; each tree attends over its request's own cache, read in
place, under its own tree mask, and its entries are written straight into it): no cache is
copied and no padding row computed, and the results are bit-identical to the request's forward
of its own (row-invariant kernels; a mixed-adapter batch's LoRA deltas added to each tree's
rows with its own adapter's weights). Elsewhere (no kernels, or peft's adapter hooks) the
caches are stacked into one padded batch (row b: request b's tree of T_b nodes, padded to T =
max T_b, a padding node seeing only itself, as a fully masked row would be NaN; each cache
padded to the longest, copied once per step) and each request's tree entries appended to its
cache afterwards, exactly as a forward of its own would have done (up to the batched kernels'
summation order). Masked keys get exactly zero attention weight, so
each row's features are the request's own.
``GenerationStream.conclude`` then verifies and commits as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from selfspec.drafting.taps import LayerTaps, TapRecord
from selfspec.generation import DraftedStep, RequestState, after_prefix_mask
from selfspec.prefill import PrefillChunk, PrefillProgress, run_prefill_chunk
from selfspec.target_forward import TargetForward


@dataclass(frozen=True)
class VerifiedRows:
    features: list[torch.Tensor]
    """Each request's tree features # [T_b, H]."""
    prefills: list[tuple[torch.Tensor, torch.Tensor | None]]
    """Each prefill chunk's last hidden states # [n, H] and, with taps, its tapped layer
    states # [n, k * H]: for ``GenerationStream.absorb_prefill``."""
    forward_tokens: int
    """The rows the forward computed: the trees' nodes and the chunks' tokens back to back, or
    the batch times the largest tree (padded) plus the chunks; what a cost curve prices."""


@dataclass(frozen=True)
class _Segment:
    """Tokens that run over one cache: a request's tree or a prefill's chunk."""

    cache: DynamicCache
    tokens: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    mask: torch.Tensor  # [1, n, cache + n] additive
    taps: LayerTaps | None


def verify_features(
    target: TargetForward, requests: Sequence[tuple[RequestState, DraftedStep]]
) -> list[torch.Tensor]:
    """Each request's tree features # [T_b, H] from one forward (``verify_rows``)."""
    return verify_rows(target, requests).features


def ragged_possible(target: TargetForward) -> bool:
    """Whether trees verified on ``target`` now run back to back (``verify_rows``): where the
    kernels' whole body runs, with the LoRA bank's adapters (one, or one per request) or none;
    peft's adapter layers keep it from running, and the trees are padded then."""
    return target.whole_body_runs()


def verify_rows(
    target: TargetForward,
    requests: Sequence[tuple[RequestState, DraftedStep]],
    prefills: Sequence[tuple[PrefillProgress, PrefillChunk]] = (),
) -> VerifiedRows:
    """Run the trees of ``requests``, and the chunks of ``prefills``, through the target in one
    forward.

    Each request's cache has its tree's KV entries appended (as ``TargetForward.features``
    does for one request), and a request whose heads read tapped layers (EAGLE-3) gets their
    states in ``state.draft_features``; each prefill's cache gets its chunk's entries. Trees
    and chunks run back to back with no padding where the kernels' whole body can take them so
    (``ragged_possible``); else the trees are padded to the largest and each chunk runs in a
    forward of its own."""
    for state, _ in requests:
        cached = state.cache.get_seq_length()
        if cached != state.committed_len:
            raise ValueError(
                f"a request's cache holds {cached} entries but {state.committed_len} are "
                "committed: its previous step was not concluded"
            )
    segments = [
        _Segment(
            state.cache,
            drafted.tree.tokens,
            drafted.buffers.position_ids[0],
            drafted.buffers.attention_mask[0],
            state.taps,
        )
        for state, drafted in requests
    ] + [
        _Segment(
            progress.cache, chunk.tokens, chunk.positions, _chunk_mask(target, chunk), progress.taps
        )
        for progress, chunk in prefills
    ]
    if not segments:
        return VerifiedRows([], [], 0)
    sizes = [int(segment.tokens.shape[0]) for segment in segments]
    with _tapped([s.taps for s in segments]) as records:
        features = _ragged_forward(target, segments, sizes)  # [1, N, H]
    if features is not None:
        split = {key: record.stacked()[0].split(sizes) for key, record in records.items()}
        rows = list(features[0].split(sizes))
        tapped = [None if s.taps is None else split[id(s.taps)][i] for i, s in enumerate(segments)]
        computed = sum(sizes)
    else:
        rows, tapped, computed = _apart(target, requests, prefills)
    for row, (state, _) in enumerate(requests):
        if state.taps is not None:
            state.draft_features = tapped[row]  # [T_b, k * H]
    count = len(requests)
    return VerifiedRows(
        rows[:count], list(zip(rows[count:], tapped[count:], strict=True)), computed
    )


@contextlib.contextmanager
def _tapped(taps: Sequence[LayerTaps | None]) -> Iterator[dict[int, TapRecord]]:
    """Every distinct tap of ``taps`` recording the forward run inside, keyed by ``id``."""
    distinct = {id(t): t for t in taps if t is not None}
    with contextlib.ExitStack() as stack:
        records = {key: stack.enter_context(t.capture()) for key, t in distinct.items()}
        with record_function("selfspec.verify_forward"):
            yield records


def _chunk_mask(target: TargetForward, chunk: PrefillChunk) -> torch.Tensor:
    """A prefill chunk's mask as a segment takes it # [1, n, end] additive (a chunk without one
    is the first, over an empty cache: causal)."""
    mask = chunk.mask if chunk.mask is not None else after_prefix_mask(0, chunk.end, target)
    return mask[0]


def _ragged_forward(
    target: TargetForward, segments: Sequence[_Segment], sizes: list[int]
) -> torch.Tensor | None:
    """The segments (of ``sizes`` tokens) back to back in one whole-body forward, each over its
    own cache, none padded # [1, N, H]; None where that cannot run (nothing is written then)."""
    with record_function("selfspec.batch_buffers"):
        tokens = torch.cat([s.tokens for s in segments])[None]  # [1, N]
        positions = torch.cat([s.positions for s in segments])[None]  # [1, N]
        masks = [s.mask.to(target.dtype) for s in segments]  # [1, n_g, L_g + n_g] each
    return target.features_rows(tokens, positions, [s.cache for s in segments], sizes, masks)


def _apart(
    target: TargetForward,
    requests: Sequence[tuple[RequestState, DraftedStep]],
    prefills: Sequence[tuple[PrefillProgress, PrefillChunk]],
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int]:
    """Where the segments cannot run back to back: the trees in one padded forward, each chunk
    in a forward of its own. Each segment's features # [n, H] and tapped states # [n, k * H]
    (or None), and the rows computed."""
    rows: list[torch.Tensor] = []
    tapped: list[torch.Tensor | None] = []
    computed = 0
    if requests:
        sizes = [drafted.tree.size for _, drafted in requests]
        with _tapped([state.taps for state, _ in requests]) as records:
            features = _padded_forward(target, requests)  # [B, T, H]
        states = {key: record.stacked() for key, record in records.items()}  # [B, T, k * H]
        rows += [features[row, :size] for row, size in enumerate(sizes)]
        tapped += [
            None if state.taps is None else states[id(state.taps)][row, :size]
            for row, ((state, _), size) in enumerate(zip(requests, sizes, strict=True))
        ]
        computed += len(sizes) * max(sizes)
    for progress, chunk in prefills:
        features, states = run_prefill_chunk(target, progress, chunk)
        rows.append(features)
        tapped.append(states)
        computed += int(chunk.tokens.shape[0])
    return rows, tapped, computed


def _padded_forward(
    target: TargetForward, requests: Sequence[tuple[RequestState, DraftedStep]]
) -> torch.Tensor:
    """The trees as a batch padded to the largest, over the caches stacked into one batch
    (where the whole body cannot run, so the trees cannot run back to back) # [B, T, H]."""
    sizes = [drafted.tree.size for _, drafted in requests]
    lengths = [state.committed_len for state, _ in requests]
    batch, prefix, width = len(requests), max(lengths), max(sizes)
    device = target.device
    with record_function("selfspec.batch_buffers"):
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)  # [B, T]
        positions = torch.zeros(batch, width, dtype=torch.long, device=device)  # [B, T]
        for row, ((_, drafted), size, length) in enumerate(
            zip(requests, sizes, lengths, strict=True)
        ):
            tokens[row, :size] = drafted.tree.tokens
            positions[row, :size] = drafted.buffers.position_ids[0]
            positions[row, size:] = length
        masks = [  # [1, T, L_b + T] each
            _tree_mask(drafted, length, width, target.dtype)
            for (_, drafted), length in zip(requests, lengths, strict=True)
        ]
    return _stacked_forward(target, requests, tokens, positions, masks, prefix)


def _tree_mask(drafted: DraftedStep, length: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A request's tree mask padded to ``width`` nodes: [1, width, length + width] additive. A
    padding node sees only itself (a fully masked row would be NaN)."""
    size = drafted.tree.size
    tree_mask = drafted.buffers.attention_mask[0, 0]  # [T_b, L_b + T_b]
    mask = tree_mask.new_full((1, width, length + width), torch.finfo(dtype).min, dtype=dtype)
    mask[0, :size, : length + size] = tree_mask
    padding = torch.arange(size, width, device=mask.device)
    mask[0, padding, length + padding] = 0.0
    return mask


def _stacked_forward(
    target: TargetForward,
    requests: Sequence[tuple[RequestState, DraftedStep]],
    tokens: torch.Tensor,  # [B, T]
    positions: torch.Tensor,  # [B, T]
    masks: Sequence[torch.Tensor],  # [1, T, L_b + T] each, from _tree_mask
    prefix: int,
) -> torch.Tensor:
    """The forward over the requests' caches stacked into one padded batch (each padded to
    ``prefix`` entries), each request's tree entries appended to its own cache afterwards.
    # [B, T, H]"""
    (batch, width), dtype = tokens.shape, target.dtype
    with record_function("selfspec.batch_buffers"):
        mask = torch.full(  # [B, 1, T, L + T]
            (batch, 1, width, prefix + width),
            torch.finfo(dtype).min,
            dtype=dtype,
            device=target.device,
        )
        for row, ((state, _), own) in enumerate(zip(requests, masks, strict=True)):
            length = state.committed_len
            mask[row, 0, :, :length] = own[0, :, :length]
            mask[row, 0, :, prefix : prefix + width] = own[0, :, length:]
        stacked = _stacked_cache(target, [state.cache for state, _ in requests], prefix)
    with record_function("selfspec.verify_forward"):
        features = target.features(tokens, positions, stacked, mask)  # [B, T, H]
    with record_function("selfspec.batch_unstack"):
        for row, (state, drafted) in enumerate(requests):
            size = drafted.tree.size
            for own, shared in zip(state.cache.layers, stacked.layers, strict=True):
                own.update(
                    shared.keys[row : row + 1, :, prefix : prefix + size],
                    shared.values[row : row + 1, :, prefix : prefix + size],
                )
    return features


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
