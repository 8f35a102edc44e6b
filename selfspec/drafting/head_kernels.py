"""The draft heads on the row-invariant kernels, int8 weights and activations, where the target
runs on them.

A drafting step runs the heads on 1-16 rows at a time (one tree depth, or the accepted path in
``advance``), right after a target forward has pushed the heads' weights out of the caches: small
M and cold weights, where torch's CPU GEMM is slowest. Drafts only propose tokens, so how the
heads round never changes an output (verification decides), and their weights can be read as
int8 codes with a scale per output channel (``selfspec.kernels.weights.quantize_int8``), a
quarter of the bytes. The heads keep their dense weights (training, draft deltas and the heads'
fingerprint see the same Parameters); only their no-grad CPU forward changes
(``selfspec.kernels.modules.KernelLinear``).

Measured on the shipped EAGLE head (AVX-512 EPYC, 1 thread, 4 requests decoding together, per
round: concluding the 4 steps, mostly ``advance``, + drafting the 4 trees): torch fp32 10.8 + 7.8
ms, kernels fp32 8.7 + 5.5 ms, kernels int8 5.5 + 2.8 ms; τ with a dynamic (4, 4, 8) tree on 8
held-out prompts 2.019 (fp32 heads) vs 2.011 (int8).

Since 2026-12-06 the activations are int8 too where a layer's rows split into blocks of 32
(``w8a8``: the interleaved ``int8_a8`` kernel, integer dot products; every layer of the shipped
heads): on an AMX-capable Xeon, 1 thread, 4 held-out prompts x 96 tokens, dynamic (4, 4, 8) tree,
drafting per step 6.75 -> 4.84 ms with a w4a8 target (spec. 67.7 -> 73.8 tok/s) and 6.84 -> 4.97
ms with a float32 one; τ 2.07 -> 2.05 and 2.13 -> 2.12.
"""

from __future__ import annotations

from torch import nn

from selfspec.kernels.modules import install_kernels, uses_kernels

HEADS_KERNEL_MODE = "w8a8"


def draft_modules(drafter: object, heads: nn.Module) -> list[nn.Module]:
    """What a drafting step runs besides the target: the heads, and the copy of the lm_head's
    draft rows an EAGLE / Medusa projection keeps (``DraftProjection.rows``)."""
    modules = [heads]
    rows = getattr(getattr(drafter, "projection", None), "rows", None)
    if isinstance(rows, nn.Module):
        modules.append(rows)
    return modules


def heads_on_kernels(drafter: object, heads: nn.Module, target_model: nn.Module) -> int:
    """Run the linear layers of ``drafter``'s modules through the kernels (int8 weights and
    activations) if ``target_model`` runs through them and the modules sit on the CPU. Returns
    how many layers now do (0: the target does not use the kernels)."""
    if not uses_kernels(target_model):
        return 0
    return sum(
        install_kernels(module, HEADS_KERNEL_MODE)
        for module in draft_modules(drafter, heads)
        if all(p.device.type == "cpu" for p in module.parameters())
    )
