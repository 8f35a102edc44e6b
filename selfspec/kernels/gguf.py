"""A GGUF file's own quantized blocks as kernel weights, so quantized modes compute with the
weights the file holds rather than a re-quantization of their dequantized copy.

Q4_1 tensors become ``q4_1`` kernel weights and Q8_0 tensors ``int8`` ones with a scale per 32
weights; other GGUF types are left to the caller (quantized from the dense weights). Each
weight is checked against the dense weight transformers converted from the same file: the
dequantized blocks must equal it exactly, or loading fails naming the tensor. The query and key
projections are stored in GGUF with their rows permuted for llama.cpp's rotary layout; the rows
are put back in transformers' order (the check proves the order).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from selfspec.kernels.weights import Q4_BLOCK, KernelWeight

logger = logging.getLogger(__name__)

Q4_1_TYPE, Q8_0_TYPE = "Q4_1", "Q8_0"
_LAYER_TENSORS = {
    "attn_q": ("self_attn", "q_proj"),
    "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"),
    "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}


class GGUFWeightError(ValueError):
    """A GGUF tensor's blocks do not reproduce the model's weight; the message names it."""


def gguf_kernel_weights(
    gguf: Path,
    model: nn.Module,
    types: tuple[str, ...] = (Q4_1_TYPE, Q8_0_TYPE),
    strict: bool = True,
) -> dict[nn.Module, KernelWeight]:
    """Kernel weights from ``gguf``'s blocks of the given GGUF ``types``, keyed by the linear
    layer of ``model`` (a Llama-family HF model converted from that file) each belongs to. A
    tensor whose blocks do not reproduce the layer's weight exactly raises ``GGUFWeightError``
    (``strict``) or is left out (logged)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    config = model.config
    layers = model.get_decoder().layers
    targets: dict[str, tuple[nn.Linear, int | None]] = {}
    for index, layer in enumerate(layers):
        for short, (part, name) in _LAYER_TENSORS.items():
            module = getattr(getattr(layer, part), name)
            heads = {
                "attn_q": config.num_attention_heads,
                "attn_k": config.num_key_value_heads,
            }.get(short)
            targets[f"blk.{index}.{short}.weight"] = (module, heads)
    output = model.get_output_embeddings()
    names = {tensor.name for tensor in reader.tensors}
    output_name = "output.weight" if "output.weight" in names else "token_embd.weight"
    if output_name == "output.weight" or output.weight is model.get_input_embeddings().weight:
        targets[output_name] = (output, None)

    weights: dict[nn.Module, KernelWeight] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if tensor.name not in targets or kind not in types:
            continue
        module, heads = targets[tensor.name]
        out_features, in_features = module.weight.shape
        raw = np.asarray(tensor.data).reshape(out_features, in_features // Q4_BLOCK, -1)
        kernel_weight = _from_blocks(kind, raw, int(out_features), int(in_features), tensor.name)
        if heads is not None:
            kernel_weight = _rows_permuted(kernel_weight, _unpermute_rows(int(out_features), heads))
        if not torch.equal(kernel_weight.dequantized(), module.weight.detach().float()):
            message = (
                f"{gguf}: the {kind} blocks of {tensor.name} do not reproduce the converted weight "
                "exactly; is the converted model from this file?"
            )
            if strict:
                raise GGUFWeightError(message)
            logger.warning("%s; that layer stays dense", message)
            continue
        weights[module] = kernel_weight
    return weights


def _from_blocks(kind: str, raw: np.ndarray, n: int, k: int, name: str) -> KernelWeight:
    """``raw``: uint8 [N, K / 32, bytes per block] as the file stores it."""
    if kind == Q4_1_TYPE:
        if raw.shape[-1] != 20:
            raise GGUFWeightError(f"{name}: Q4_1 blocks of {raw.shape[-1]} bytes, expected 20")
        scale = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        minimum = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        nibbles = torch.from_numpy(raw[..., 4:20].copy())
        return KernelWeight("q4_1", nibbles, n, k, scale=scale, minimum=minimum, group=Q4_BLOCK)
    if raw.shape[-1] != 34:
        raise GGUFWeightError(f"{name}: Q8_0 blocks of {raw.shape[-1]} bytes, expected 34")
    scale = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = torch.from_numpy(raw[..., 2:34].copy().view(np.int8).reshape(n, k))
    return KernelWeight("int8", codes, n, k, scale=scale, group=Q4_BLOCK)


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary permutation of a query/key projection: row
    (head, half, i) of transformers' layout is row (head, i, half) of the GGUF one. # [rows]"""
    per_half = rows // heads // 2
    return torch.arange(rows).view(heads, per_half, 2).transpose(1, 2).reshape(rows)


def _rows_permuted(weight: KernelWeight, order: torch.Tensor) -> KernelWeight:
    def take(table: torch.Tensor | None) -> torch.Tensor | None:
        return None if table is None else table[order].contiguous()

    return KernelWeight(
        weight.format,
        take(weight.data),
        weight.out_features,
        weight.in_features,
        scale=take(weight.scale),
        minimum=take(weight.minimum),
        group=weight.group,
    )
