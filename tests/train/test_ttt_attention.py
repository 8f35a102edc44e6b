"""The training-time test's structured attention equals the dense masked one it replaces."""

from __future__ import annotations

import pytest
import torch

from selfspec.heads import EagleCache
from selfspec.train.eagle3_loss import unrolled_attend
from selfspec.train.ttt_attention import UnrolledKV


def _steps(cache, qs, ks, vs, width: int) -> list[torch.Tensor]:
    return [
        cache.attention(0, q, k, v, unrolled_attend(width, step, q.device))
        for step, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True), 1)
    ]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
def test_structured_attention_equals_the_dense_mask_with_gradients(
    heads: int, kv_heads: int
) -> None:
    torch.manual_seed(heads)
    batch, width, dim, steps = 2, 11, 8, 5
    leaves = [
        [torch.randn(batch, n, width, dim, requires_grad=True) for _ in range(steps)]
        for n in (heads, kv_heads, kv_heads)
    ]
    dense = _steps(EagleCache(), *leaves, width)
    dense_grads = torch.autograd.grad(
        sum((o * o.roll(1, -1)).sum() for o in dense), sum(leaves, [])
    )
    fast = _steps(UnrolledKV(), *leaves, width)
    fast_grads = torch.autograd.grad(sum((o * o.roll(1, -1)).sum() for o in fast), sum(leaves, []))
    for step, (want, got) in enumerate(zip(dense, fast, strict=True), 1):
        torch.testing.assert_close(got, want, msg=f"step {step}")
    for want, got in zip(dense_grads, fast_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_only_one_layer_is_unrolled() -> None:
    x = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="one-layer head"):
        UnrolledKV().attention(1, x, x, x, unrolled_attend(3, 1, x.device))
