"""The fused soft-label KL gives the value and gradient of log_softmax + kl_div."""

from __future__ import annotations

import pytest
import torch

from selfspec.train.losses import soft_kl
from selfspec.train.soft_labels import SoftLabels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kl_equals_the_reference_with_gradients(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    target = torch.randn(9, 40) * 3
    labels = SoftLabels.from_logits(target)
    rows = torch.tensor([4, 0, 0, 8, 2])
    draft = (torch.randn(5, 40) * 2).to(dtype).requires_grad_(True)
    got = labels.kl(draft, rows)
    (got_grad,) = torch.autograd.grad(got * 3, draft)
    reference = draft.detach().float().requires_grad_(True)
    want = soft_kl(reference, target[rows])
    (want_grad,) = torch.autograd.grad(want * 3, reference)
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got, want)
    tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got_grad.float(), want_grad, **tol)


def test_labels_are_the_targets_distribution() -> None:
    target = torch.tensor([[0.0, 0.0, 10.0], [1.0, 1.0, 1.0]])
    labels = SoftLabels.from_logits(target)
    assert labels.tokens.tolist() == [2, 0] or labels.tokens.tolist() == [2, 1]
    torch.testing.assert_close(labels.probs.sum(-1), torch.ones(2))
    torch.testing.assert_close(labels.entropy[1], torch.log(torch.tensor(3.0)))
    perfect = labels.kl(target.clone().requires_grad_(True), torch.arange(2))
    assert abs(float(perfect)) < 1e-5


def test_no_rows_means_all_rows_in_order() -> None:
    torch.manual_seed(1)
    labels = SoftLabels.from_logits(torch.randn(6, 30))
    draft = torch.randn(6, 30)
    torch.testing.assert_close(labels.kl(draft, None), labels.kl(draft, torch.arange(6)))
