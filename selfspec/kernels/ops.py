"""The two kernel calls, each with its pure-torch fallback.

``linear`` and ``attention`` run the C++ kernels where they are built (``extension.load()``),
else pure torch. Both paths are row-invariant, each by its own construction: the C++ kernels by
a fixed reduction order per output element (see ``csrc/body.h``), the fallback by computing
each row alone, as a one-row call (up to ``FALLBACK_ROW_LIMIT`` rows, i.e. any verification; a
longer call, a prompt's prefill, runs as one matrix product). The two paths round differently
from each other: a process uses one of them throughout, so speculative and plain decoding agree.
"""

from __future__ import annotations

import weakref

import torch
from torch.nn import functional as F

from selfspec.kernels import extension
from selfspec.kernels.weights import (
    ACTIVATION_BLOCK,
    STORED_AS,
    KernelWeight,
    activation_suffix,
    column_table,
    integer_activations,
)

FALLBACK_ROW_LIMIT = 64
MASKED = -1.0e30  # additive mask values at or below this are masked out


def kernel_isa() -> str:
    """Which path runs here: "avx512", "avx2" (the C++ kernels) or "torch" (the fallback)."""
    return extension.active_isa() or "torch"


def linear(
    x: torch.Tensor,  # [..., K] float32 or bfloat16, contiguous
    weight: KernelWeight,
    bias: torch.Tensor | None = None,  # [N] float32
) -> torch.Tensor:
    """``x @ weight.T + bias`` through the C++ kernel, computed in fp32 (a bf16 x: its exact
    values), returned in x's dtype (bf16 rounded as ``.to(torch.bfloat16)`` rounds). # [..., N]"""
    module = extension.load()
    if module is None:
        raise extension.KernelError("the C++ kernels are not built here; use linear_fallback")
    return module.linear(
        x,
        weight.code,
        weight.data,
        weight.scale,
        weight.minimum,
        bias,
        weight.group or weight.in_features,
        weight.out_features,
        extension.requested_isa(),
    )


def linear_rows(
    x: torch.Tensor,  # [..., K] float32, contiguous
    weight: KernelWeight,
    rows: torch.Tensor,  # [N'] int64, each in [0, N)
) -> torch.Tensor:
    """``x @ weight[rows].T`` through the C++ kernel, reading only those weight rows in place
    (nothing gathered): each column has the bits of the full product's column. # [..., N']

    An interleaved weight (q4_1_a8, int8_a8, q4_1_a24, int8_a24: columns in groups of 16) has
    its rows gathered
    into a new one first, kept for the next call with the same rows (a draft vocabulary is
    asked for at every draft step): its kernel computes every column alone, so the bits are
    the same."""
    if weight.format in STORED_AS:
        return linear(x, _selected_rows(weight, rows))
    return _module().linear_rows(
        x,
        weight.code,
        weight.data,
        weight.scale,
        weight.minimum,
        weight.group or weight.in_features,
        rows.long().contiguous(),
        extension.requested_isa(),
    )


SELECTIONS_KEPT = 8  # row selections kept per interleaved weight (one per draft vocabulary)
_SELECTED: weakref.WeakKeyDictionary[KernelWeight, list[tuple[torch.Tensor, KernelWeight]]] = (
    weakref.WeakKeyDictionary()
)


def _selected_rows(weight: KernelWeight, rows: torch.Tensor) -> KernelWeight:
    """An interleaved weight's rows ``rows`` as a weight of their own; the last
    ``SELECTIONS_KEPT`` selections of each weight are kept (adapters with their own draft
    vocabularies take turns)."""
    kept = _SELECTED.setdefault(weight, [])
    for i, (chosen, selected) in enumerate(kept):
        if chosen.shape == rows.shape and torch.equal(chosen, rows):
            kept.append(kept.pop(i))  # most recently used last
            return selected
    if rows.numel() and not (int(rows.min()) >= 0 and int(rows.max()) < weight.out_features):
        raise RuntimeError(
            f"rows must lie in [0, {weight.out_features}), got [{int(rows.min())}, "
            f"{int(rows.max())}]"
        )
    selected = integer_activations(weight.row_major(rows.long()), activation_suffix(weight.format))
    kept.append((rows.clone(), selected))
    del kept[:-SELECTIONS_KEPT]
    return selected


def linear_fallback(
    x: torch.Tensor,  # [M, K]
    dense: torch.Tensor,  # [N, K], the dequantized weight, x's dtype
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Row by row, each row computed as a one-row product (row-invariant). # [M, N]

    Each row is copied to fresh (aligned) memory first: BLAS kernels take different paths, and
    round differently, for a row that starts at another alignment."""
    rows = x.shape[0]
    if rows > FALLBACK_ROW_LIMIT:
        return F.linear(x, dense, bias)
    return torch.cat([F.linear(x[i : i + 1].clone(), dense, bias) for i in range(rows)])


def linear_int_fallback(
    x: torch.Tensor,  # [M, K] float32
    weight: KernelWeight,  # an integer-activation weight (int8_a8, q4_1_a8, int8_a24, q4_1_a24)
    codes: torch.Tensor,  # [N, K / 32, 32] float32: the weight's codes (``integer_weight_codes``)
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """The integer-activation formats in pure torch, row by row (row-invariant): each row's
    blocks of 32 quantized (``_a8``: d = max|x| / 127, codes round(x / d); ``_a24``: d = 2^(e-22)
    for the block's largest magnitude in [2^(e-1), 2^e), codes round(x / d)), exact integer
    block sums, then y = sum_b s_b d_b I_b (+ sum_b min_b d_b sum(codes_b) for Q4_1). Computes
    what the C++ kernel computes, in another order. # [M, N] float32"""
    n, blocks = codes.shape[0], codes.shape[1]
    # The tables per column [N, R] (an interleaved weight's are grouped by 16 columns).
    scale = column_table(weight.scale, n)
    minimum = None if weight.minimum is None else column_table(weight.minimum, n)
    if weight.stored != "q4_1":
        per_block = weight.group // ACTIVATION_BLOCK if weight.group < weight.in_features else 0
        if per_block:  # one scale per `per_block` blocks (the row's last group may be shorter)
            scale = scale.repeat_interleave(per_block, 1)[:, :blocks]
        scale, minimum = scale.expand(n, blocks), None
    wide = activation_suffix(weight.format) == "_a24"
    out = []
    for row in x.float().view(-1, blocks, ACTIVATION_BLOCK):  # [blocks, 32]
        d, row_codes = _quantized_blocks(row, wide)
        # exact integers (float64 holds the _a24 sums, up to 2^31, exactly)
        sums = torch.einsum("bk,nbk->nb", row_codes.double(), codes.double()).float()
        y = (sums * (scale * d)).sum(dim=-1)
        if minimum is not None:
            y = y + (minimum * (d * row_codes.sum(dim=-1))).sum(dim=-1)
        out.append(y if bias is None else y + bias)
    return torch.stack(out) if out else x.new_zeros(0, n)


def _quantized_blocks(row: torch.Tensor, wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's blocks # [blocks, 32] as scales # [blocks] and integer codes # [blocks, 32]."""
    top = row.abs().amax(dim=-1)  # [blocks]
    if not wide:
        d = top / 127.0
        inverse = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
        return d, torch.round(row * inverse[:, None]).clamp(-127, 127)
    exponent = torch.frexp(top).exponent
    live = (top > 0) & (exponent >= -104)
    d = torch.where(live, torch.ldexp(torch.ones_like(top), exponent - 22), 0.0)
    inverse = torch.where(live, torch.ldexp(torch.ones_like(top), 22 - exponent), 0.0)
    return d, torch.round(row * inverse[:, None])


def integer_weight_codes(weight: KernelWeight) -> torch.Tensor:
    """The integer codes of an int8 or Q4_1 weight, as floats. # [N, K / 32, 32] float32"""
    n, k = weight.out_features, weight.in_features
    weight = weight.row_major()
    if weight.format == "int8":
        return weight.data.float().view(n, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    return torch.cat(((weight.data & 0x0F).float(), (weight.data >> 4).float()), dim=-1)


def rms_norm(
    x: torch.Tensor,  # [..., H] float32
    weight: torch.Tensor,  # [H] float32
    eps: float,
) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))``, each row in a fixed order (C++). # [..., H]"""
    return _module().rms_norm(
        x.contiguous(), weight.contiguous(), float(eps), extension.requested_isa()
    )


def rotary_(
    x: torch.Tensor,  # [B, S, heads, D] float32, contiguous
    cos: torch.Tensor,  # [B, S, D] float32
    signed_sin: torch.Tensor,  # [B, S, D] float32, first half negated
) -> torch.Tensor:
    """``x * cos + swap_halves(x) * signed_sin`` in place (C++), the same bits as those three
    torch ops. # [B, S, heads, D]"""
    _module().rotary_(x, cos.contiguous(), signed_sin.contiguous())
    return x


def _module():
    module = extension.load()
    if module is None:
        raise extension.KernelError("the C++ kernels are not built here")
    return module


def attention(
    query: torch.Tensor,  # [B, S, H, D]
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,  # [B, Hkv, T, D]
    mask: torch.Tensor | None,  # [B, S, T] additive float32, or None: causal over the cache
    scale: float,
) -> torch.Tensor:
    """Attention of each query row over the keys its mask allows, in a fixed order per row (a
    masked key changes nothing, not even a rounding). # [B, S, H, D], query's dtype"""
    module = extension.load()
    if module is None:
        return attention_fallback(query, key, value, mask, scale)
    kv_dtype = torch.bfloat16 if key.dtype == torch.bfloat16 else torch.float32
    key, value = _key_value_rows(key.to(kv_dtype), value.to(kv_dtype))
    out = module.attention(
        query.float().contiguous(),
        key,
        value,
        None if mask is None else mask.float().contiguous(),
        float(scale),
        extension.requested_isa(),
    )
    return out.to(query.dtype)


def _key_value_rows(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value # [B, Hkv, T, D] as the kernel reads them: each key's D values contiguous,
    keys D apart, the same strides for both. A window of a longer cache (sliced along T) already
    is and is read in place; anything else is copied."""
    dim = key.shape[-1]
    in_place = key.stride() == value.stride() and key.stride(3) == 1 and key.stride(2) == dim
    return (key, value) if in_place else (key.contiguous(), value.contiguous())


def attention_fallback(
    query: torch.Tensor,  # [B, S, H, D]
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,  # [B, Hkv, T, D]
    mask: torch.Tensor | None,  # [B, S, T] or None (causal)
    scale: float,
) -> torch.Tensor:
    """Pure torch: each query row alone over its allowed keys, gathered in key order, in fp32.
    # [B, S, H, D]"""
    batch, length, heads, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    out = torch.empty(batch, length, heads, dim, dtype=torch.float32)
    for b in range(batch):
        for s in range(length):
            if mask is None:
                allowed = torch.arange(total - length + s + 1)
                bias = None
            else:
                allowed = (mask[b, s] > MASKED).nonzero().flatten()
                bias = mask[b, s, allowed].float()  # [n]
            if allowed.numel() == 0:
                out[b, s] = 0.0
                continue
            keys = key[b][:, allowed].float().repeat_interleave(groups, dim=0)  # [H, n, D]
            values = value[b][:, allowed].float().repeat_interleave(groups, dim=0)  # [H, n, D]
            row = query[b, s].to(torch.float32, copy=True)  # [H, D], fresh aligned memory
            scores = torch.bmm(row[:, None], keys.transpose(1, 2))[:, 0] * scale
            if bias is not None:
                scores = scores + bias  # [H, n]
            weights = torch.softmax(scores, dim=-1)
            out[b, s] = torch.bmm(weights[:, None], values)[:, 0]
    return out.to(query.dtype)
