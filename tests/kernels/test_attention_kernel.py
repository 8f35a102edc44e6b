"""The fixed-order attention: a row attends exactly as it would alone over just its allowed keys
(bitwise), masked keys change nothing, close to SDPA, both C++ paths and the fallback."""

from __future__ import annotations

import pytest
import torch
from conftest import cpp_paths
from torch.nn import functional as F

from selfspec.kernels import extension, ops

MASKED = torch.finfo(torch.float32).min


def inputs(
    batch: int,
    length: int,
    total: int,
    heads: int = 6,
    kv_heads: int = 2,
    dim: int = 24,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, length, heads, dim, generator=generator)
    key = torch.randn(batch, kv_heads, total, dim, generator=generator) * 2
    value = torch.randn(batch, kv_heads, total, dim, generator=generator)
    allowed = torch.rand(batch, length, total, generator=generator) < 0.6
    allowed[..., 0] = True  # every row sees at least one key
    mask = torch.where(allowed, torch.zeros(()), torch.tensor(MASKED))
    return query.to(dtype), key.to(dtype), value.to(dtype), mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("length", "total", "dim"), [(1, 7, 24), (5, 40, 64), (16, 70, 64), (9, 33, 128)]
)
def test_a_row_attends_as_it_would_alone_over_its_allowed_keys(
    kernel_path: str, length: int, total: int, dim: int, dtype: torch.dtype
) -> None:
    query, key, value, mask = inputs(2, length, total, dim=dim, dtype=dtype)
    together = ops.attention(query, key, value, mask, 0.3)  # [B, S, H, D]
    for b in range(2):
        for s in range(length):
            keep = (mask[b, s] == 0).nonzero().flatten()
            # Only its allowed keys, contiguous, unmasked: how plain decoding sees a path.
            alone = ops.attention(
                query[b : b + 1, s : s + 1],
                key[b : b + 1, :, keep],
                value[b : b + 1, :, keep],
                None,
                0.3,
            )
            assert torch.equal(alone[0, 0], together[b, s]), f"batch {b} row {s}"
    reference = F.scaled_dot_product_attention(
        query.float().transpose(1, 2),
        key.float(),
        value.float(),
        attn_mask=mask[:, None],
        scale=0.3,
        enable_gqa=True,
    ).transpose(1, 2)
    torch.testing.assert_close(
        together.float(), reference, atol=2e-2 if dtype == torch.bfloat16 else 2e-5, rtol=0
    )


def test_masked_keys_change_nothing_not_even_nan(kernel_path: str) -> None:
    query, key, value, mask = inputs(1, 4, 30)
    mask[..., 10:15] = MASKED  # no row sees keys 10-14
    before = ops.attention(query, key, value, mask, 0.2)
    key[:, :, 10:15] = float("nan")
    value[:, :, 10:15] = 1e30
    assert torch.equal(ops.attention(query, key, value, mask, 0.2), before)


def test_causal_without_a_mask_is_the_causal_mask(kernel_path: str) -> None:
    query, key, value, _ = inputs(1, 6, 20)
    causal = torch.full((1, 6, 20), MASKED).triu(20 - 6 + 1)  # query s sees keys <= 14 + s
    assert torch.equal(
        ops.attention(query, key, value, None, 0.4), ops.attention(query, key, value, causal, 0.4)
    )


def test_a_row_with_no_key_gives_zeros_not_nan(kernel_path: str) -> None:
    query, key, value, mask = inputs(1, 3, 8)
    mask[0, 1] = MASKED
    out = ops.attention(query, key, value, mask, 0.5)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    assert not out.isnan().any()


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 1, 128), (10, 2, 80)])
def test_heads_sharing_a_key_value_head_attend_as_each_would_alone(
    kernel_path: str, heads: int, kv_heads: int, dim: int
) -> None:
    """The query heads of one key/value head are attended together (each key and value row read
    once for the group); each head's output has the bits it has with its own copy of the keys."""
    query, key, value, mask = inputs(2, 5, 70, heads=heads, kv_heads=kv_heads, dim=dim)
    grouped = ops.attention(query, key, value, mask, 0.2)
    group = heads // kv_heads
    one_each = ops.attention(
        query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), mask, 0.2
    )
    assert torch.equal(grouped, one_each)


@pytest.mark.skipif(len(cpp_paths()) < 2, reason="needs both C++ paths on this CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_and_avx512_attention_give_the_same_bits(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    query, key, value, mask = inputs(2, 7, 45, dim=64, dtype=dtype)
    results = []
    for isa in ("avx512", "avx2"):
        monkeypatch.setenv(extension.ISA_ENV, isa)
        results.append(ops.attention(query, key, value, mask, 0.125))
    assert torch.equal(results[0], results[1])


@pytest.mark.skipif(not cpp_paths(), reason="the C++ kernels are not built here")
def test_the_extension_checks_attention_arguments() -> None:
    module = extension.load()
    query, key, value, mask = inputs(1, 3, 8)
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        module.attention(
            query, key[:, :1].repeat(1, 4, 1, 1), value[:, :1].repeat(1, 4, 1, 1), None, 1.0, "auto"
        )
    with pytest.raises(RuntimeError, match="mask must be float32"):
        module.attention(query, key, value, mask[:, :2], 1.0, "auto")
    with pytest.raises(RuntimeError, match="head size above 128"):
        big = torch.zeros(1, 1, 2, 136)
        module.attention(
            big,
            big[:, :, :1].transpose(1, 2).contiguous(),
            big[:, :, :1].transpose(1, 2).contiguous(),
            None,
            1.0,
            "auto",
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_window_of_a_longer_cache_is_read_in_place_with_the_same_bits(
    kernel_path: str, dtype: torch.dtype
) -> None:
    """Batched generation keeps one cache buffer per layer, [B, Hkv, capacity, D], and passes the
    window a step reads (sliced along the keys) without copying it."""
    query, key, value, mask = inputs(3, 1, 30, dim=64, dtype=dtype)
    buffer_k = torch.randn(3, 2, 50, 64).to(dtype)
    buffer_v = torch.randn(3, 2, 50, 64).to(dtype)
    buffer_k[:, :, 12:42], buffer_v[:, :, 12:42] = key, value
    window_k, window_v = buffer_k[:, :, 12:42], buffer_v[:, :, 12:42]
    assert not window_k.is_contiguous()
    copied = ops.attention(query, key, value, mask, 0.125)
    in_place = ops.attention(query, window_k, window_v, mask, 0.125)
    assert torch.equal(copied, in_place)
    # Keys and values with different layouts are copied, never misread.
    mixed = ops.attention(query, window_k, value, mask, 0.125)
    assert torch.equal(copied, mixed)
