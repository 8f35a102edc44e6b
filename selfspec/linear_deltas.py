"""Forward hooks that add a low-rank delta to a linear layer's output, described as tensors so
that a fused body can add it itself.

A hook on a linear layer keeps the fused body (``selfspec.lean_body``) from running that layer
in C++: it cannot know what the hook does. A hook marked with ``mark_delta_hook`` promises that
it only adds ``(x A) B`` to the output, with ATen ops that the fused body repeats op for op
(so the bits are the same), and says which tensors for the next forward through
``fused_delta(batch)``:

- ``None``: nothing to add (the base, or an adapter that leaves this layer alone);
- ``(a, b)`` with ``a`` # [in, r] and ``b`` # [r, out]: every row adds ``x @ a @ b``, as
  ``out.view(-1, out).addmm_(mm(x.view(-1, in), a), b)``;
- ``(a, b)`` with ``a`` # [batch, in, r] and ``b`` # [batch, r, out]: row i adds
  ``x[i] @ a[i] @ b[i]``, as ``out.baddbmm_(bmm(x, a), b)``.

The LoRA bank's hooks (``selfspec.adapters.fast_lora``) are such hooks.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

_DELTA_HOOK = "_selfspec_delta_hook"

Delta = tuple[torch.Tensor, torch.Tensor] | None


class DeltaHook(Protocol):
    def fused_delta(self, batch: int) -> Delta: ...


def mark_delta_hook(cls: type) -> type:
    """Class decorator: instances are forward hooks that only add the delta ``fused_delta``
    describes."""
    setattr(cls, _DELTA_HOOK, True)
    return cls


def delta_hook(module: nn.Module) -> DeltaHook | None | bool:
    """The one delta hook on ``module``; False if it has any other hook (or several), None if
    it has none."""
    if module._forward_pre_hooks or getattr(module, "_backward_hooks", None):
        return False
    hooks = list(module._forward_hooks.values())
    if not hooks:
        return None
    if len(hooks) == 1 and getattr(hooks[0], _DELTA_HOOK, False):
        return hooks[0]
    return False
