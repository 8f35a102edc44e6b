"""Linear layers that run through the kernels: ``KernelLinear``, installed on a loaded target.

``install_kernels`` turns every plain ``nn.Linear`` of a model into a ``KernelLinear`` holding its
weight in one of the kernel formats (``selfspec.kernels.weights``). A ``KernelLinear`` *is* an
``nn.Linear`` with its dense weight kept (peft wraps it, the LoRA bank hooks it, ``state_dict``
and the fingerprint see the same Parameter, training runs ``F.linear`` on it); only its no-grad
CPU forward changes: activations go through the kernel in fp32, the result comes back in the
input's dtype. LoRA deltas, applied by peft or the LoRA bank on top of the layer's output, stay
in their own dtype.

Modes (what ``TargetSpec.dtype`` names):

- ``float32`` / ``bfloat16``: the dense weight read in place, products accumulated in fp32
  (bfloat16: a bf16 model's activations are bf16 values, so where the CPU has AVX-512 BF16 its
  dot-product instruction computes them, with the bits of the other paths);
  float32 from a GGUF file's blocks (``given``) reads those, dequantized in the kernel, or with
  ``activations="int24"`` computes with each block of 32 activations as 24-bit integers under a
  power-of-two scale (float32-grade, integer dot products: faster on AVX2 and AVX-512 VNNI).
- ``int8``: per-output-channel int8 codes (weight-only; activations stay fp32).
- ``int4``: Q4_1 blocks (4-bit codes, scale and minimum per 32 weights) for every layer but the
  output layer, which is int8 with a scale per 32 weights (as GGUF's Q8_0). From a GGUF file the
  blocks are the file's own (``selfspec.kernels.gguf``), otherwise a Q4_1 quantization of the
  dense weights.
- ``w4a8``: int4's weights, computing with activations quantized to int8 per block of 32 at run
  time (integer dot products, as llama.cpp runs a Q4_1 file): lossy against float activations,
  cheaper per row where compute, not memory, bounds a forward (verifying a tree).
- ``w8a8`` (the draft heads', ``selfspec.drafting.head_kernels``; not a target mode): int8's
  per-channel weights computing with int8 activations where a layer's inputs split into blocks
  of 32, int8 as above where not.

A weight replaced or changed in place (a merged adapter) is converted again on the next call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from selfspec.kernels import extension, ops
from selfspec.kernels.weights import (
    KernelWeight,
    activation_suffix,
    dense_weight,
    integer_activations,
    quantize_int8,
    quantize_q4_1,
)

logger = logging.getLogger(__name__)

MODES = ("float32", "bfloat16", "int8", "int4", "w4a8", "w8a8")
OUTPUT_GROUP = 32  # int4 mode's output layer: int8 with a scale per 32 weights (GGUF's Q8_0)


class KernelLinear(nn.Linear):
    """An ``nn.Linear`` (made by ``install_kernels``, never constructed directly) whose no-grad
    CPU forward runs the row-invariant kernel on ``_kernel_weight``."""

    _kernel_weight: KernelWeight
    _kernel_kind: str  # "dense", "int8", "int8_group", "q4_1" (+ "_a8"): how to convert a change
    _weight_key: tuple[int, int]
    _fallback_dense: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            x.device.type != "cpu"
            or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            return F.linear(x, weight, self.bias)
        kernel_weight = self.kernel_weight()
        if extension.load() is None:
            rows = x.reshape(-1, x.shape[-1])  # [M, K]
            if kernel_weight.stored != kernel_weight.format:  # int8 activations
                bias = None if self.bias is None else self.bias.float()
                out = ops.linear_int_fallback(rows, kernel_weight, self._dense(), bias)
                return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
            dense = self._dense()
            bias = None if self.bias is None else self.bias.to(dense.dtype)
            out = ops.linear_fallback(rows.to(dense.dtype), dense, bias)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        # A decoding step calls this ~200 times: the kernel takes [..., K] as it is, fp32 or
        # bf16 (a bf16 model's activations, returned in bf16 as .to rounds), and nothing is
        # converted here that is already one of those and contiguous.
        native = x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous()
        rows = x if native else x.float().contiguous()
        bias = None if self.bias is None else self.bias.float()
        out = ops.linear(rows, kernel_weight, bias)  # [..., N] in rows' dtype
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def kernel_weight(self) -> KernelWeight:
        """The weight in kernel form, converted again if the dense weight changed since."""
        weight = self.weight
        key = (weight.data_ptr(), weight._version)
        if key != self._weight_key:
            logger.info("weight of %s changed: converting it again (%s)", self, self._kernel_kind)
            self._kernel_weight = _convert(weight, self._kernel_kind)
            self._weight_key = key
            self._fallback_dense = None
        return self._kernel_weight

    def _dense(self) -> torch.Tensor:
        """What the pure-torch fallback reads, made once: the kernel weight dequantized
        # [N, K], or for int8 activations its codes # [N, K / 32, 32]."""
        if self._fallback_dense is None:
            weight = self.kernel_weight()
            if weight.stored != weight.format:
                self._fallback_dense = ops.integer_weight_codes(weight)
            else:
                self._fallback_dense = weight.dequantized()
        return self._fallback_dense


def _convert(weight: torch.Tensor, kind: str) -> KernelWeight:
    suffix = activation_suffix(kind)
    if suffix:
        return integer_activations(_convert(weight, kind.removesuffix(suffix)), suffix)
    if kind == "dense":
        return dense_weight(weight)
    if kind == "int8":
        return quantize_int8(weight)
    if kind == "int8_group":
        return quantize_int8(weight, OUTPUT_GROUP)
    return quantize_q4_1(weight)


ACTIVATIONS = ("float", "int24")  # how float32 mode's quantized weights meet the activations


def install_kernels(
    model: nn.Module,
    mode: str,
    output_layer: nn.Module | None = None,
    given: Mapping[nn.Module, KernelWeight] | None = None,
    activations: str = "float",
) -> int:
    """Turn every plain ``nn.Linear`` under ``model`` into a ``KernelLinear`` in ``mode`` (one of
    ``MODES``). ``output_layer``: the layer int4 mode keeps at 8 bits. ``given``: kernel weights
    to use as they are for some layers (a GGUF file's own blocks). ``activations``: "int24" has
    float32 mode's given quantized weights compute with 24-bit integer activations
    (``activations_int24``; a layer whose weight cannot stays as it is). Returns how many."""
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, got {mode!r}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    given = given or {}
    count = 0
    for sub in list(model.modules()):
        if type(sub) is not nn.Linear or sub.weight.device.type != "cpu":
            continue
        kind = _kind_for(sub, mode, sub is output_layer)
        kernel_weight = given.get(sub)
        if kernel_weight is not None:
            kernel_weight = _with_activations(kernel_weight, kind, mode, activations, sub)
        if kernel_weight is None:
            if kind == "dense" and sub.weight.dtype != _dense_dtype(mode):
                raise ValueError(
                    f"{mode} kernels need {_dense_dtype(mode)} weights, got {sub.weight.dtype}"
                )
            kernel_weight = _convert(sub.weight, kind)
        sub.__class__ = KernelLinear
        sub._kernel_weight = kernel_weight
        sub._kernel_kind = kind
        sub._weight_key = (sub.weight.data_ptr(), sub.weight._version)
        sub._fallback_dense = None
        count += 1
    return count


def _with_activations(
    weight: KernelWeight, kind: str, mode: str, activations: str, layer: nn.Module
) -> KernelWeight:
    """A given weight computing with the activations its layer's kind (or float32's
    ``activations``) asks for."""
    suffix = activation_suffix(kind)
    if suffix:
        return integer_activations(weight, suffix)
    if mode != "float32" or activations == "float" or weight.format not in ("q4_1", "int8"):
        return weight
    try:
        return integer_activations(weight, "_a24")
    except ValueError as err:  # e.g. an int8 code of -128, or K not a multiple of 32
        logger.warning("%s keeps float activations: %s", layer, err)
        return weight


def _dense_dtype(mode: str) -> torch.dtype:
    return torch.bfloat16 if mode == "bfloat16" else torch.float32


def _kind_for(layer: nn.Linear, mode: str, is_output: bool) -> str:
    if mode in ("float32", "bfloat16"):
        return "dense"
    if mode == "int8":
        return "int8"
    if mode == "w8a8":  # int8 weights and activations where the rows split into blocks of 32
        return "int8_a8" if layer.in_features % 32 == 0 else "int8"
    # int4 and w4a8 (the same weights, w4a8 with int8 activations: K a multiple of 32 too)
    suffix = "_a8" if mode == "w4a8" else ""
    if layer.in_features % 32:
        if not is_output:
            logger.warning(
                "%s: %d inputs is not a multiple of 32; int8 weights, float activations",
                layer,
                layer.in_features,
            )
        return "int8"
    return ("int8_group" if is_output else "q4_1") + suffix


def uses_kernels(module: nn.Module) -> bool:
    """Whether any linear layer under ``module`` runs through the kernels."""
    return any(type(sub) is KernelLinear for sub in module.modules())


def kernel_mode_of(module: nn.Module) -> str | None:
    """A short description of the kernel formats under ``module`` (for cache keys), or None."""
    kinds = sorted(
        {sub._kernel_weight.format for sub in module.modules() if type(sub) is KernelLinear}
    )
    return "+".join(kinds) if kinds else None


def weight_bytes(module: nn.Module) -> int:
    """Bytes of kernel weights a forward of ``module`` streams."""
    return sum(sub._kernel_weight.nbytes for sub in module.modules() if type(sub) is KernelLinear)
