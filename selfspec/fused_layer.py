"""A decoder layer's three parts as one C++ call each (``kernels/csrc/decoder_layer.cpp``).

On the lean body's fp32 kernel path a layer is ~20 torch ops and module calls; a 1-token step of
SmolLM2-135M (30 layers) spent ~8 ms of its ~21 ms in that Python, more than in its linear
layers. ``FusedLayer`` runs the same computation as three calls:

- attention inputs: input norm, q/k/v projections, rotary embedding;
- attention output: attention over the cache, o_proj, residual add;
- MLP block: post-attention norm, gate and up, silu, product, down, residual add,

with the same kernels and ATen ops in the same order, so the bits are the same (tests compare
with ``torch.equal``). A layer runs in its norms' dtype (``FUSED_DTYPES``): a bf16 model's
layers (~2,700 small torch calls a token from Python before) compute transformers' RMS norm and
the lean body's rotary with the very ATen ops of its module path. A part runs fused only while
its modules are as installed: every linear a plain ``KernelLinear``, no forward hooks on any of
them, no global module hooks, no gradient wanted. For the whole body as one call
(``decoder_body``, ``selfspec.lean_body``; its check is ``selfspec.fused_body``) two kinds of
hook are allowed, because that call does their work itself with the same bits: a tap's reader
hooks on the input norm (``selfspec.reader_hooks``: EAGLE-3) and one delta hook per linear layer
(``selfspec.linear_deltas``: the LoRA bank). Otherwise the lean body calls the modules, part by
part, and the result is the same either way. A weight changed in place or replaced (a merged
adapter) rebuilds the layer's plan from the layers' current kernel weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from selfspec.kernels import extension
from selfspec.kernels.modules import KernelLinear

FUSABLE_MLPS = ("LlamaMLP", "Qwen2MLP", "MistralMLP")  # down(act(gate(x)) * up(x))
SILU_MODULES = ("SiLU", "SiLUActivation")  # torch's and transformers' (F.silu, both)
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_DTYPES = (torch.float32, torch.bfloat16)
"""A layer runs fused in its norms' dtype: fp32 with the kernels' norm and rotary, bf16 with
transformers' norm and the lean body's rotary as ATen ops (``decoder_layer.cpp``)."""


@dataclass(frozen=True)
class FusedParts:
    """Which of a layer's parts run as one C++ call in this forward."""

    attention_inputs: bool = False
    attention_output: bool = False
    mlp: bool = False


NOT_FUSED = FusedParts()
ALL_FUSED = FusedParts(attention_inputs=True, attention_output=True, mlp=True)


def unfusable_reason(layer: nn.Module) -> str | None:
    """Why ``layer`` can never run fused (its kind, not its momentary hooks), or None."""
    attention, mlp = layer.self_attn, layer.mlp
    if type(mlp).__name__ not in FUSABLE_MLPS:
        return f"its MLP is a {type(mlp).__name__}, not one of {FUSABLE_MLPS}"
    if type(getattr(mlp, "act_fn", None)).__name__ not in SILU_MODULES:
        return "its MLP's activation is not SiLU"
    for name, linear in zip(_LINEARS, _linears(attention, mlp), strict=True):
        if type(linear) is not KernelLinear:
            return f"{name} is a {type(linear).__name__}, not a KernelLinear"
    dtypes = {norm.weight.dtype for norm in (layer.input_layernorm, layer.post_attention_layernorm)}
    if len(dtypes) != 1 or not dtypes <= set(FUSED_DTYPES):
        return f"its norms' weights are {sorted(map(str, dtypes))}, not one of {FUSED_DTYPES}"
    return None


def _linears(attention: nn.Module, mlp: nn.Module) -> tuple[nn.Module, ...]:
    return (
        attention.q_proj,
        attention.k_proj,
        attention.v_proj,
        attention.o_proj,
        mlp.gate_proj,
        mlp.up_proj,
        mlp.down_proj,
    )


def hooked(*modules: nn.Module) -> bool:
    """Whether any of ``modules`` has a forward or forward pre-hook."""
    return any(module._forward_hooks or module._forward_pre_hooks for module in modules)


def fusable_input(hidden: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a forward of ``hidden`` may run fused at all through layers of ``dtype``: that
    dtype on the CPU, no gradient wanted, no global module hooks (they would see every module
    called)."""
    return (
        hidden.dtype == dtype
        and hidden.device.type == "cpu"
        and not (torch.is_grad_enabled() and hidden.requires_grad)
        and not torch_module._global_forward_hooks
        and not torch_module._global_forward_pre_hooks
    )


def _tensor_key(tensor: torch.Tensor | None) -> tuple[int, int] | None:
    return None if tensor is None else (tensor.data_ptr(), tensor._version)


class FusedLayer:
    """One decoder layer (``unfusable_reason`` None) and its C++ plan. ``parts`` is asked first
    in every forward: it says which parts may run and brings the plan up to date."""

    def __init__(self, layer: nn.Module) -> None:
        reason = unfusable_reason(layer)
        if reason is not None:
            raise ValueError(f"this decoder layer can't run fused: {reason}")
        self.layer = layer
        attention, mlp = layer.self_attn, layer.mlp
        self.linears = _linears(attention, mlp)
        self.norms = (layer.input_layernorm, layer.post_attention_layernorm)
        self.dtype = self.norms[0].weight.dtype  # the stream's dtype it runs fused for
        self.mlp_modules = (layer.post_attention_layernorm, mlp, mlp.act_fn)  # besides linears
        self._plan = None
        self._plan_key: tuple | None = None
        # Read every forward, so kept flat: (a module's children, name, the child planned with);
        # (a module's parameters, name) for the tensors the plan was made from.
        self.children = [
            (layer._modules, "self_attn", attention),
            (layer._modules, "mlp", mlp),
            (layer._modules, "input_layernorm", self.norms[0]),
            (layer._modules, "post_attention_layernorm", self.norms[1]),
        ] + [
            (owner._modules, name, linear)
            for owner, name, linear in zip(
                (attention,) * 4 + (mlp,) * 3, _LINEARS, self.linears, strict=True
            )
        ]
        self.planned_tensors = [
            (module._parameters, name)
            for module in (*self.linears, *self.norms)
            for name in ("weight", "bias")
            if name in module._parameters
        ]

    def parts(self, hidden: torch.Tensor) -> FusedParts:
        """Which parts may run fused for this forward's ``hidden`` # [B, S, H]; the plan is
        brought up to date for them. (The whole body as one call has its own check,
        ``selfspec.fused_body``, which also allows reader and delta hooks.)"""
        if not fusable_input(hidden, self.dtype) or self._modules_replaced():
            return NOT_FUSED
        linear_ok = [not hooked(linear) for linear in self.linears]
        parts = FusedParts(
            attention_inputs=not hooked(self.norms[0]) and all(linear_ok[:3]),
            attention_output=linear_ok[3],
            mlp=not hooked(*self.mlp_modules) and all(linear_ok[4:]),
        )
        if parts != NOT_FUSED:
            self.refresh_plan()
        return parts

    @property
    def plan(self):
        """The layer's C++ plan (``DecoderLayerPlan``), current after ``parts``."""
        return self._plan

    def _modules_replaced(self) -> bool:
        """Whether a module was swapped since (peft wraps a linear layer in its own)."""
        return any(children.get(name) is not module for children, name, module in self.children)

    def refresh_plan(self) -> None:
        """Make the C++ plan again if a weight changed since (in place or replaced)."""
        key = tuple(_tensor_key(params[name]) for params, name in self.planned_tensors)
        if key != self._plan_key:
            self._plan = self._make_plan()
            self._plan_key = key

    def _make_plan(self):
        module = extension.load()
        matrices = []
        for linear in self.linears:
            weight = linear.kernel_weight()
            bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
            matrices.append(
                module.KernelMatrix(
                    weight.code,
                    weight.data,
                    weight.scale,
                    weight.minimum,
                    bias,
                    weight.group or weight.in_features,
                    weight.out_features,
                )
            )
        attention = self.layer.self_attn
        head_dim = attention.head_dim
        return module.DecoderLayerPlan(
            self.norms[0].weight.detach(),
            self.norms[0].variance_epsilon,
            self.norms[1].weight.detach(),
            self.norms[1].variance_epsilon,
            matrices,
            self.linears[0].out_features // head_dim,
            self.linears[1].out_features // head_dim,
            head_dim,
            attention.scaling,
        )

    def attention_inputs(
        self,
        hidden: torch.Tensor,  # [B, S, H]
        cos: torch.Tensor,  # [B, S, D]
        signed_sin: torch.Tensor,  # [B, S, D]
        isa: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query [B, S, heads, D], key [B, kv_heads, S, D], value [B, kv_heads, S, D])."""
        query, key, value = extension.load().attention_inputs(
            self._plan, hidden, cos, signed_sin, isa
        )
        return query, key, value

    def attention_output(
        self,
        hidden: torch.Tensor,  # [B, S, H]
        query: torch.Tensor,  # [B, S, heads, D]
        keys: torch.Tensor,  # [B, kv_heads, T, D], the cache after this step's update
        values: torch.Tensor,  # [B, kv_heads, T, D]
        mask: torch.Tensor | None,  # [B, S, T] additive, or None (causal)
        isa: str,
    ) -> torch.Tensor:
        """hidden + o_proj(attention). # [B, S, H]"""
        return extension.load().attention_output(self._plan, hidden, query, keys, values, mask, isa)

    def mlp_block(self, hidden: torch.Tensor, isa: str) -> torch.Tensor:
        """hidden + mlp(post_attention_layernorm(hidden)). # [B, S, H]"""
        return extension.load().mlp_block(self._plan, hidden, isa)
