"""The small-M linear kernel: row invariance (bitwise), accuracy against torch, both C++ paths
and the fallback, every weight format (integer activations included), clear errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import cpp_paths

from selfspec.kernels import extension, ops
from selfspec.kernels.modules import KernelLinear, install_kernels
from selfspec.kernels.weights import (
    KernelWeight,
    activation_suffix,
    activations_int8,
    activations_int24,
    dense_weight,
    integer_activations,
    quantize_int8,
    quantize_q4_1,
)

SHAPES = [(64, 32), (37, 19), (96, 130), (576, 24)]  # (in K, out N): tails in K and in N
# "_a8": the same weight computing with int8 activations (W8A8 / W4A8); "_a24": with 24-bit
# integer activations (float32's arithmetic on VNNI / AMX)
INTEGER_FORMATS = ["int8_a8", "int8_g32_a8", "q4_1_a8", "int8_a24", "int8_g32_a24", "q4_1_a24"]
FORMATS = ["float32", "bfloat16", "int8", "int8_g32", "q4_1", *INTEGER_FORMATS]


def make_weight(fmt: str, n: int, k: int, seed: int = 0) -> KernelWeight:
    suffix = activation_suffix(fmt)
    if suffix:
        return integer_activations(make_weight(fmt.removesuffix(suffix), n, k, seed), suffix)
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if fmt == "float32":
        return dense_weight(dense)
    if fmt == "bfloat16":
        return dense_weight(dense.bfloat16())
    if fmt == "int8":
        return quantize_int8(dense)
    if fmt == "int8_g32":
        return quantize_int8(dense, 32)
    return quantize_q4_1(dense)


def run(x: torch.Tensor, weight: KernelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The active path: the C++ kernel, or the fallback on the dequantized weight."""
    if extension.load() is None and weight.stored != weight.format:
        return ops.linear_int_fallback(x, weight, ops.integer_weight_codes(weight), bias)
    if extension.load() is None:
        dense = weight.dequantized()
        out = ops.linear_fallback(
            x.to(dense.dtype), dense, None if bias is None else bias.to(dense.dtype)
        )
        return out.float()
    return ops.linear(x, weight, bias)


def supported(fmt: str, k: int) -> bool:
    needs_blocks = fmt.startswith("q4_1") or bool(activation_suffix(fmt))
    return not ((needs_blocks and k % 32) or (fmt == "int8_g32" and k < 32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_a_row_is_the_same_whatever_shares_the_call(
    kernel_path: str, fmt: str, k: int, n: int
) -> None:
    if not supported(fmt, k):
        pytest.skip(f"{fmt} needs K divisible by 32")
    weight = make_weight(fmt, n, k)
    generator = torch.Generator().manual_seed(k * n)
    bias = torch.randn(n, generator=generator) if k == 96 else None
    for rows in (64, 17, 5, 3):
        x = torch.randn(rows, k, generator=generator) * torch.logspace(-2, 2, k)
        together = run(x, weight, bias)  # [rows, N]
        for i in range(rows):
            alone = run(x[i : i + 1].contiguous(), weight, bias)
            assert torch.equal(alone[0], together[i]), f"row {i} of {rows}"
        # Any sub-batch, in another order, too.
        order = torch.randperm(rows, generator=generator)[: max(1, rows // 2)]
        assert torch.equal(run(x[order].contiguous(), weight, bias), together[order])
        if activation_suffix(fmt):
            check_integer_activations(x, weight, bias, together)
            continue
        dense = weight.dequantized().float()
        # The fallback runs bf16 in bf16 (inputs rounded, bf16 results); the kernel sums in fp32.
        low_precision = kernel_path == "torch" and fmt == "bfloat16"
        inputs = x.bfloat16().float() if low_precision else x
        expected = inputs @ dense.T + (0 if bias is None else bias)
        bound = (inputs.abs() @ dense.abs().T).max().item()  # size of the sums' terms
        tolerance = (1e-2 if low_precision else 1e-6) * bound
        torch.testing.assert_close(together, expected, atol=tolerance, rtol=0)


def check_integer_activations(
    x: torch.Tensor, weight: KernelWeight, bias: torch.Tensor | None, out: torch.Tensor
) -> None:
    """Integer activations: the defined arithmetic (the torch reference, another summation
    order) to float noise, and float activations to within each block's rounding: 8-bit for
    int8 activations, float noise for 24-bit ones (fp32's own error, 1e-6 of the terms, is
    the bound the float formats meet above)."""
    reference = ops.linear_int_fallback(x, weight, ops.integer_weight_codes(weight), bias)
    dense = weight.dequantized().float()
    bound = (x.abs() @ dense.abs().T).max().item()
    torch.testing.assert_close(out, reference, atol=1e-5 * bound, rtol=0)
    exact = x.double() @ dense.double().T + (0 if bias is None else bias.double())
    error = (out.double() - exact).abs().max().item()
    wide = activation_suffix(weight.format) == "_a24"
    assert error <= (2e-6 if wide else 1e-2) * bound, f"{weight.format} off by {error} of {bound}"
    assert not torch.equal(out, x @ dense.T + (0 if bias is None else bias))


def _amx_ready() -> bool:
    module = extension.load()
    return module is not None and module.amx_ready()


@pytest.mark.skipif(not _amx_ready(), reason="no AMX tiles on this CPU (or not granted)")
@pytest.mark.parametrize("fmt", INTEGER_FORMATS)
def test_amx_tiles_give_the_vnni_paths_bits(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer-activation calls of 8 rows or more (q4_1_a8: 12) run on AMX tiles where there
    are some: the same exact integer block sums and float steps as VNNI, so the same bits (and
    so the same as one row)."""
    weight = make_weight(fmt, 70, 96)
    for rows in (8, 9, 12, 16, 17, 40):
        x = torch.randn(rows, 96) * torch.logspace(-2, 2, 96)
        tiles = ops.linear(x, weight)
        monkeypatch.setenv("SELFSPEC_KERNEL_AMX", "0")
        vnni = ops.linear(x, weight)
        monkeypatch.delenv("SELFSPEC_KERNEL_AMX")
        assert torch.equal(tiles, vnni), f"{rows} rows"
        assert torch.equal(tiles[5], ops.linear(x[5:6].contiguous(), weight)[0])


@pytest.mark.skipif(len(cpp_paths()) < 2, reason="needs both C++ paths on this CPU")
@pytest.mark.parametrize("fmt", FORMATS)
def test_avx2_and_avx512_paths_give_the_same_bits(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = make_weight(fmt, 70, 96)
    x = torch.randn(9, 96)
    results = []
    for isa in ("avx512", "avx2"):
        monkeypatch.setenv(extension.ISA_ENV, isa)
        results.append(ops.linear(x, weight))
    assert torch.equal(results[0], results[1])


def bf16_dot_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The bf16 format's documented sum, in plain torch: lane j of 16 takes, for each block of 32
    (zero-padded), the product of element 2j + 1, then of 2j, each added with one fp32 rounding
    (the products of bf16 values are exact, so float64 then float32 is that rounding), then the
    lanes are summed i + i+8, i + i+4, i + i+2, 0 + 1. # [M, N]"""
    rows, k = x.shape
    length = (k + 31) // 32 * 32
    xs = torch.nn.functional.pad(x.double(), (0, length - k))
    ws = torch.nn.functional.pad(weight.double(), (0, length - k))
    acc = torch.zeros(rows, weight.shape[0], 16)
    for start in range(0, length, 32):
        for parity in (1, 0):
            lanes = slice(start + parity, start + 32, 2)
            products = xs[:, None, lanes] * ws[None, :, lanes]
            acc = (acc.double() + products).float()
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half : 2 * half]
    return acc[..., 0]


def _bf16_dots() -> bool:
    module = extension.load()
    return module is not None and module.bf16_dot_ready()


@pytest.mark.skipif(not cpp_paths(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize(("k", "n"), [(576, 40), (37, 19), (96, 130), (1536, 9)])
def test_bf16_weights_sum_in_the_dot_product_order_on_every_path(
    k: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 weights sum as AVX-512 BF16's dot-product instruction does, so that instruction (where
    the CPU has it and x holds bf16 values, as a bf16 model's activations do), the AVX-512 and
    the AVX2 paths' fused multiply-adds give the same bits, those of the documented order; for
    every row count a tile shape covers (one column up to 8 rows, 12 x 2 up to 32, 4 x 4 beyond)
    and for rows that are not bf16 values (no dot products then, the same order)."""
    generator = torch.Generator().manual_seed(k + n)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    kernel_weight = dense_weight(weight)
    paths = [("avx512", "1"), ("avx512", "0"), ("avx2", "1")]
    paths = [(isa, dots) for isa, dots in paths if isa in cpp_paths()]
    for rows in (1, 3, 8, 9, 31, 33, 64):
        scaled = torch.randn(rows, k, generator=generator) * torch.logspace(-2, 2, k)
        for x in (scaled.bfloat16().float(), scaled):
            expected = bf16_dot_order(x, weight)
            for isa, dots in paths:
                monkeypatch.setenv(extension.ISA_ENV, isa)
                monkeypatch.setenv("SELFSPEC_KERNEL_BF16", dots)
                out = ops.linear(x, kernel_weight)
                assert torch.equal(out, expected), f"{rows} rows on {isa}, dot products {dots}"
                assert torch.equal(ops.linear(x[-1:].contiguous(), kernel_weight)[0], out[-1])
                chosen = torch.tensor([n - 1, 0, n // 2])
                assert torch.equal(ops.linear_rows(x, kernel_weight, chosen), out[:, chosen])


@pytest.mark.skipif(not _bf16_dots(), reason="no AVX-512 BF16 on this CPU")
def test_bf16_dot_products_flush_denormals_as_the_other_paths_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The instruction flushes denormal inputs and results to zero; the fused multiply-adds of the
    other paths run with flush-to-zero and denormals-are-zero set for the call, so a sum that
    ends below the normal range is 0 on every path (and the setting is restored after)."""
    tiny = 2.0**-70  # products 2^-140: below fp32's normal range (2^-126)
    x = torch.full((2, 64), tiny).bfloat16().float()
    x[1, 0] = 1.0
    weight = dense_weight(torch.full((3, 64), tiny).bfloat16())
    outs = []
    for dots in ("1", "0"):
        monkeypatch.setenv("SELFSPEC_KERNEL_BF16", dots)
        outs.append(ops.linear(x, weight))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][0], torch.zeros(3))
    assert torch.equal(outs[0][1], torch.full((3,), tiny).bfloat16().float())
    # Denormals still work outside the call (the thread's setting restored).
    assert torch.tensor(2.0**-140) * 2 > 0


@pytest.mark.skipif(not cpp_paths(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_activations_come_back_in_bf16_as_converting_around_the_call(fmt: str) -> None:
    """A bf16 x (a bf16 model's activations) gives what converting it to fp32 before the call and
    the result to bf16 after gives, bit for bit: the kernel computes on its exact values and
    rounds as ``.to(torch.bfloat16)`` does."""
    weight = make_weight(fmt, 70, 96)
    generator = torch.Generator().manual_seed(7)
    bias = torch.randn(70, generator=generator)
    x = (torch.randn(2, 5, 96, generator=generator) * 3).bfloat16()
    for rows in (x, x[:1, :1]):
        out = ops.linear(rows, weight, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (*rows.shape[:-1], 70)
        assert torch.equal(out, ops.linear(rows.float(), weight, bias).bfloat16())
    assert ops.linear(x[:, :0], weight).dtype == torch.bfloat16
    if weight.stored == weight.format:  # a row selection reads plain rows only
        chosen = torch.tensor([69, 0, 3])
        selected = ops.linear_rows(x, weight, chosen)
        assert torch.equal(selected, ops.linear_rows(x.float(), weight, chosen).bfloat16())


def test_q4_1_dequantizes_as_gguf_does() -> None:
    """(q * d) + m in fp32 with two roundings, GGUF's reference formula (gguf-py)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    weight = quantize_q4_1(torch.randn(8, 64))
    blocks = torch.cat(
        (
            weight.scale.half().view(torch.uint8).view(8, 2, 2),
            weight.minimum.half().view(torch.uint8).view(8, 2, 2),
            weight.data,
        ),
        dim=-1,
    )  # [N, K / 32, 20]: GGUF's Q4_1 block layout
    reference = dequantize(blocks.reshape(8, 40).numpy(), GGMLQuantizationType.Q4_1)
    assert torch.equal(weight.dequantized(), torch.from_numpy(reference))
    if extension.load() is not None:  # and the kernel computes with exactly those weights
        x = torch.zeros(1, 64)
        for j in range(64):
            x.zero_()
            x[0, j] = 1.0
            assert torch.equal(ops.linear(x, weight)[0], weight.dequantized()[:, j])


def test_kernel_linear_module_keeps_training_and_peft_paths(kernel_path: str) -> None:
    layer = torch.nn.Linear(64, 16)
    reference = torch.nn.Linear(64, 16)
    reference.load_state_dict(layer.state_dict())
    assert install_kernels(torch.nn.Sequential(layer), "float32") == 1
    assert type(layer) is KernelLinear and isinstance(layer, torch.nn.Linear)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference(x), atol=1e-5, rtol=1e-5)
    # With autograd it is F.linear on the dense weight (training, recalibration).
    x.requires_grad_(True)
    assert torch.equal(layer(x), reference(x))
    # A weight changed in place is converted again.
    with torch.no_grad():
        layer.weight.mul_(2)
        reference.weight.mul_(2)
        torch.testing.assert_close(layer(x), reference(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: KernelWeight("int3", torch.zeros(2, 2), 2, 2), "format must be one of"),
        (lambda: KernelWeight("float32", torch.zeros(2, 3), 2, 2), "must be torch.float32"),
        (lambda: quantize_q4_1(torch.zeros(4, 20)), "divisible by 32"),
        (lambda: quantize_int8(torch.zeros(4, 64), 24), "power of two"),
        (lambda: dense_weight(torch.zeros(2, 2, dtype=torch.float16)), "float32 or bfloat16"),
        (lambda: activations_int8(quantize_int8(torch.zeros(4, 48))), "divisible by 32"),
        (lambda: activations_int8(quantize_int8(torch.zeros(4, 64), 16)), "multiple of 32"),
        (lambda: activations_int8(dense_weight(torch.zeros(2, 32))), "int8 or q4_1 weights"),
        (lambda: activations_int8(_int8_with(-128)), r"\[-127, 127\]"),
        (lambda: activations_int24(_int8_with(-128)), r"int8_a24 needs int8 codes"),
        (lambda: integer_activations(quantize_int8(torch.zeros(4, 64)), "_a16"), "one of"),
        (lambda: _q4_1_with_scale(0.1), "float16 values"),
    ],
)
def test_bad_weights_are_clear_errors(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def _q4_1_with_scale(scale: float) -> KernelWeight:
    weight = quantize_q4_1(torch.randn(2, 32))
    return replace(weight, scale=torch.full_like(weight.scale, scale))


def _int8_with(code: int) -> KernelWeight:
    weight = quantize_int8(torch.randn(3, 64))
    weight.data[1, 5] = code
    return weight


@pytest.mark.skipif(not cpp_paths(), reason="the C++ kernels are not built here")
def test_int8_activations_with_a_last_group_shorter_than_the_others() -> None:
    """int8 groups of 64 over 96 inputs: two scales per row, the second for 32 weights."""
    weight = activations_int8(quantize_int8(torch.randn(20, 96), 64))
    x = torch.randn(3, 96)
    expected = ops.linear_int_fallback(x, weight, ops.integer_weight_codes(weight))
    torch.testing.assert_close(ops.linear(x, weight), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int8_g32", "q4_1"])
def test_int8_activations_interleave_the_same_codes_and_scales(fmt: str) -> None:
    """The *_A8 formats hold the stored format's codes interleaved by 16 columns (N not a
    multiple of 16: the last group padded); ``row_major`` gives them back unchanged."""
    plain = make_weight(fmt, 37, 64)
    interleaved = activations_int8(plain)
    assert interleaved.format == plain.format + "_a8"
    assert interleaved.data.shape[0] == 3  # ceil(37 / 16) groups
    back = interleaved.row_major()
    assert back.format == plain.format
    for field in ("data", "scale", "minimum"):
        if getattr(plain, field) is None:
            assert getattr(back, field) is None
        else:
            assert torch.equal(getattr(back, field), getattr(plain, field))
    assert torch.equal(interleaved.dequantized(), plain.dequantized())
    # Column c of group g: run t holds its elements 4t..4t+3 (int8) at bytes 4c..4c+3.
    if plain.format == "int8":
        assert torch.equal(interleaved.data[1, 0, 2, 4 * 5 : 4 * 5 + 4], plain.data[16 + 5, 8:12])


@pytest.mark.skipif(not cpp_paths(), reason="the C++ kernels are not built here")
def test_24_bit_activations_keep_a_blocks_small_and_large_values() -> None:
    """Each block's integers follow its largest magnitude (a power-of-two scale): a block of
    values near 1e-30 and one near 1e+30 in the same row both keep float32-grade precision,
    an all-zero block and a block below 2^-105 give nothing (no NaN), and the int8_a24 and
    q4_1_a24 weights relabel the same interleaved codes as *_a8."""
    plain = quantize_q4_1(torch.randn(24, 128))
    weight = activations_int24(plain)
    assert activations_int8(weight).data is weight.data and weight.format == "q4_1_a24"
    x = torch.randn(2, 128)
    x[:, :32] *= 1e-30
    x[:, 32:64] *= 1e30
    x[:, 64:96] = 0.0
    x[1, 96:] = 1e-33
    out = ops.linear(x, weight)
    dense = plain.dequantized().double()
    for lo, hi in ((0, 32), (32, 64)):  # each block alone, against float64
        part = x.clone()
        keep = torch.zeros(128, dtype=torch.bool)
        keep[lo:hi] = True
        part[:, ~keep] = 0.0
        exact = part.double() @ dense.T
        bound = (part.double().abs() @ dense.abs().T).max().item()
        got = ops.linear(part, weight).double()
        assert (got - exact).abs().max().item() <= 2e-6 * bound
    assert torch.isfinite(out).all()
    tiny_only = torch.zeros(1, 128)
    tiny_only[0, 96:] = 1e-33
    assert torch.equal(ops.linear(tiny_only, weight), torch.zeros(1, 24))


@pytest.mark.skipif(not cpp_paths(), reason="the C++ kernels are not built here")
def test_leading_dimensions_are_rows() -> None:
    weight = quantize_q4_1(torch.randn(40, 64, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4))
    out = ops.linear(x, weight)
    assert out.shape == (2, 3, 40)
    assert torch.equal(out, ops.linear(x.reshape(6, 64), weight).view(2, 3, 40))


@pytest.mark.skipif(not cpp_paths(), reason="the C++ kernels are not built here")
def test_the_extension_checks_its_arguments() -> None:
    module = extension.load()
    with pytest.raises(RuntimeError, match=r"float32 or bfloat16 tensor \[\.\.\., K\]"):
        module.linear(
            torch.zeros(2, 4, dtype=torch.float64),
            0,
            torch.zeros(3, 4),
            None,
            None,
            None,
            4,
            3,
            "auto",
        )
    with pytest.raises(RuntimeError, match="x has 4 features, the weight takes 5"):
        module.linear(torch.zeros(2, 4), 0, torch.zeros(3, 5), None, None, None, 4, 3, "auto")
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        module.linear(torch.zeros(2, 4), 0, torch.zeros(3, 4), None, None, None, 4, 3, "sse9")


@pytest.mark.skipif(not cpp_paths(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize("fmt", FORMATS)
def test_selected_rows_are_the_full_products_columns(fmt: str) -> None:
    """``linear_rows`` reads only the weight rows it is given, in place (a draft vocabulary of
    the lm_head): each column has the bits of the full product's, in any order, repeated or
    not, for one row (direct path) or many (the dequantized-scratch path)."""
    weight = make_weight(fmt, 130, 64, seed=5)
    rows = torch.tensor([129, 0, 64, 7, 7, 100])
    for m in (1, 9):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        assert torch.equal(ops.linear_rows(x, weight, rows), ops.linear(x, weight)[:, rows])
    assert ops.linear_rows(x, weight, rows[:0]).shape == (9, 0)
    # Selections taking turns (adapters with their own draft vocabularies): each still exact.
    other = torch.tensor([3, 17, 16, 15])
    for chosen in (rows, other, rows, other):
        assert torch.equal(ops.linear_rows(x, weight, chosen), ops.linear(x, weight)[:, chosen])
    module = extension.load()
    with pytest.raises(RuntimeError, match=r"rows must lie in \[0, 130\)"):
        ops.linear_rows(x, weight, torch.tensor([3, 130]))
    with pytest.raises(RuntimeError, match="rows must be int64"):
        module.linear_rows(x, 0, torch.zeros(3, 64), None, None, 64, torch.zeros(2), "auto")
