"""Whether a forward may run the whole decoder body as one C++ call, checked in one flat pass.

``decoder_body`` (``selfspec.lean_body``) runs every layer at once when each layer could run all
its parts fused (``selfspec.fused_layer``): its modules as installed, its weights those its plan
was made from, and no hooks but the two kinds the call does itself (a tap's reader hooks on an
input norm, one delta hook per linear layer). Asked layer by layer (``FusedLayer.parts`` for 30
layers: a dozen child modules, 7 linear layers' hooks and 16 weight versions each) that check
took 1.2 ms of an 11.8 ms 1-token body on SmolLM2-135M (AVX-512 EPYC, 1 thread): the body's
~110 MB weight stream leaves Python's objects out of cache, and every attribute read pays for
it. ``FusedBody`` asks the same questions over flat lists made once, with a fast path for the
common case of no hooks at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from selfspec.fused_layer import FusedLayer, fusable_input, hooked
from selfspec.kernels import extension
from selfspec.linear_deltas import Delta, DeltaHook, delta_hook
from selfspec.reader_hooks import reader_hooks


@dataclass(frozen=True)
class WholeBody:
    """What one ``decoder_body`` call needs besides the activations and caches."""

    plan: object
    """The C++ ``BodyPlan`` of every layer's current plan."""
    readers: dict[int, list]
    """{layer index: the reader hooks on its input norm}, handed the stream entering it."""
    delta_hooks: list[DeltaHook | None] | None
    """Each linear layer's delta hook (7 per layer, plan order), or None when no linear layer
    has one."""

    def deltas(self, batch: int) -> list[Delta]:
        """Each linear layer's delta for a forward of ``batch`` rows (empty: none anywhere)."""
        if self.delta_hooks is None:
            return []
        deltas = [None if hook is None else hook.fused_delta(batch) for hook in self.delta_hooks]
        return deltas if any(delta is not None for delta in deltas) else []


class FusedBody:
    """The whole-body check over a body's fused layers (every layer has one)."""

    def __init__(self, layers: Sequence[FusedLayer]) -> None:
        self.layers = list(layers)
        self._children = [child for layer in self.layers for child in layer.children]
        self.dtype = layers[0].dtype if layers else torch.float32
        self._linears: list[nn.Module] = [
            linear for layer in self.layers for linear in layer.linears
        ]
        self._input_norms = [layer.norms[0] for layer in self.layers]
        self._unhooked = [module for layer in self.layers for module in layer.mlp_modules]
        self._tensors = [tensor for layer in self.layers for tensor in layer.planned_tensors]
        self._tensor_key: list | None = None
        self._plan = None
        self._plan_layers: list = []

    def check(self, hidden: torch.Tensor) -> WholeBody | None:
        """The call's plan, readers and delta hooks for this forward's ``hidden`` # [B, S, H],
        or None where some layer must run part by part (then ``FusedLayer.parts`` decides)."""
        if (
            not fusable_input(hidden, self.dtype)
            or any(children.get(name) is not module for children, name, module in self._children)
            or hooked(*self._unhooked)
        ):
            return None
        hooks: list | None = None
        if any(
            linear._forward_hooks or linear._forward_pre_hooks or linear._backward_hooks
            for linear in self._linears
        ):
            hooks = [delta_hook(linear) for linear in self._linears]
            if any(hook is False for hook in hooks):
                return None
        readers: dict[int, list] = {}
        for index, norm in enumerate(self._input_norms):
            if norm._forward_hooks or norm._forward_pre_hooks:
                found = reader_hooks(norm)
                if found is None or found[1]:
                    return None
                if found[0]:
                    readers[index] = found[0]
        return WholeBody(self._current_plan(), readers, hooks)

    def _current_plan(self):
        """The body plan, rebuilt from layers whose weights changed (in place or replaced)."""
        key = [  # fused_layer's _tensor_key inlined: a call per tensor costs what this saves
            None if (tensor := params[name]) is None else (tensor.data_ptr(), tensor._version)
            for params, name in self._tensors
        ]
        if key != self._tensor_key:
            for layer in self.layers:
                layer.refresh_plan()
            self._tensor_key = key
        plans = [layer.plan for layer in self.layers]
        if len(plans) != len(self._plan_layers) or any(
            a is not b for a, b in zip(plans, self._plan_layers, strict=True)
        ):
            self._plan = extension.load().BodyPlan(plans)
            self._plan_layers = plans  # held, so a plan's identity is never reused
        return self._plan
