"""A linear layer's weight in the form the kernels read: dense fp32 / bf16, int8 or 4-bit (Q4_1).

Formats (``KernelWeight.format``):

- ``float32``, ``bfloat16``: the layer's own weight tensor, read in place (no copy).
- ``int8``: int8 codes with an fp32 scale per ``group`` weights along a row (``group`` = the row
  length: per output channel); weight = code * scale.
- ``q4_1``: GGUF's Q4_1 blocks of 32 weights: 4-bit codes q with an fp32 scale d and minimum m
  per block (stored as fp16 in a GGUF file, exactly representable in fp32); weight = (q * d) + m,
  two roundings, exactly as GGUF's reference dequantization computes it.

``int8_a8`` and ``q4_1_a8`` store the same weights as ``int8`` and ``q4_1``, and compute with
the activations quantized to int8 per block of 32 at run time (W8A8 / W4A8: integer dot
products, llama.cpp's arithmetic; ``activations_int8`` makes one from the other). Lossy against
float activations, and a mode of its own: within it every row is still computed row-invariantly.
Both hold their codes interleaved by 16 output columns (``interleave``): one 64-byte load
gives 4 codes of each of 16 columns, what one integer dot-product instruction multiplies by 4
broadcast activation codes, so the per-block scaling is done once per 16 columns (see
``csrc/body.h``); their scales and minimums are grouped the same way ([groups of 16 columns,
rows, 16]: a group's blocks read one line after another). The same codes and scales, moved;
``row_major`` gives the plain layout back.

``int8_a24`` and ``q4_1_a24`` hold the same interleaved codes and compute with each block of 32
activations as 24-bit integers under a power-of-two scale, cut into three int8 digits: three
integer dot products per block, summed exactly (``activations_int24``). Float32-grade (each
activation kept to 2^-22 of its block's largest magnitude), float32 mode's arithmetic from a
GGUF file's blocks on AVX2 and AVX-512 VNNI (``TargetSpec.activations``).

``quantize_int8`` and ``quantize_q4_1`` quantize a dense weight; ``from_gguf_blocks`` (in
``selfspec.kernels.gguf``) takes a GGUF file's own blocks, so a 4-bit model read from GGUF
computes with the original quantized weights, not a re-quantization of their fp32 copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

FORMATS = ("float32", "bfloat16", "int8", "q4_1", "q4_1_a8", "int8_a8", "q4_1_a24", "int8_a24")
FORMAT_CODES = {
    "float32": 0,
    "bfloat16": 1,
    "int8": 2,
    "q4_1": 3,
    "q4_1_a8": 4,
    "int8_a8": 5,
    "q4_1_a24": 6,
    "int8_a24": 7,
}
# Integer activations (interleaved weights): the weight stored as
STORED_AS = {"q4_1_a8": "q4_1", "int8_a8": "int8", "q4_1_a24": "q4_1", "int8_a24": "int8"}
ACTIVATION_SUFFIXES = ("_a8", "_a24")  # int8 codes, or 24-bit integers as three int8 digits
Q4_BLOCK = 32
ACTIVATION_BLOCK = 32  # int8 activations: one scale per this many activations of a row
COLUMN_GROUP = 16  # q4_1_a8 / int8_a8: output columns interleaved together


@dataclass(frozen=True, eq=False)
class KernelWeight:
    """One linear layer's weight [out_features, in_features] as the kernels read it."""

    format: str
    """One of ``FORMATS``."""
    data: torch.Tensor
    """float32 / bfloat16 / int8 [N, K]; uint8 [N, K / 32, 16] nibbles for q4_1. Interleaved
    (``interleave``): uint8 [ceil(N / 16), K / 32, 4, 64] (q4_1_a8), int8 [.., 8, 64] (int8_a8)."""
    out_features: int
    in_features: int
    scale: torch.Tensor | None = None
    """float32 [N, groups] (int8) or [N, K / 32] (q4_1). Interleaved: [ceil(N / 16), groups, 16]
    (``grouped_table``: group g's 16 columns side by side, the last group padded with 0)."""
    minimum: torch.Tensor | None = None
    """float32 [N, K / 32] (q4_1); interleaved (q4_1_a8, q4_1_a24) grouped like ``scale``."""
    group: int = 0
    """Weights per scale along a row (int8: ``in_features`` for per-channel; q4_1: 32)."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"KernelWeight.format must be one of {FORMATS}, got {self.format!r}")
        n, k = self.out_features, self.in_features
        stored = self.stored
        expected = {
            "float32": (torch.float32, (n, k)),
            "bfloat16": (torch.bfloat16, (n, k)),
            "int8": (torch.int8, (n, k)),
            "q4_1": (torch.uint8, (n, k // Q4_BLOCK, 16)),
        }[stored]
        if self.format in STORED_AS:
            _check_int8_activations(self.format, k, self.group)
            runs = _interleaved_runs(stored)
            expected = (expected[0], (-(-n // COLUMN_GROUP), k // ACTIVATION_BLOCK, runs, 64))
        if self.data.dtype != expected[0] or tuple(self.data.shape) != expected[1]:
            raise ValueError(
                f"{self.format} weight data must be {expected[0]} {list(expected[1])}, got "
                f"{self.data.dtype} {list(self.data.shape)}"
            )
        if stored == "q4_1" and k % Q4_BLOCK:
            raise ValueError(f"q4_1 needs in_features divisible by 32, got {k}")
        if stored == "int8":
            if not (self.group >= k or (self.group >= 16 and self.group & (self.group - 1) == 0)):
                raise ValueError(
                    f"int8 group must be in_features or a power of two >= 16, got {self.group}"
                )
            groups = 1 if self.group >= k else -(-k // self.group)
            table = _grouped_shape(n, groups) if self.format in STORED_AS else (n, groups)
            _check_table(self.scale, table, f"{self.format} scale")
        if stored == "q4_1":
            if self.group != Q4_BLOCK:
                raise ValueError(f"q4_1 group must be {Q4_BLOCK}, got {self.group}")
            table = (
                _grouped_shape(n, k // Q4_BLOCK) if self.format in STORED_AS else (n, k // Q4_BLOCK)
            )
            _check_table(self.scale, table, f"{self.format} scale")
            _check_table(self.minimum, table, f"{self.format} min")
            # The kernels dequantize q * d + m with one fused multiply-add on one path and a
            # product then a sum on another; the bits agree only because q * d is exact, i.e.
            # d is a float16 value, as a GGUF file stores it (``quantize_q4_1`` rounds it so).
            if not torch.equal(self.scale, self.scale.half().float()):
                raise ValueError(f"{self.format} scales must be float16 values (as in GGUF files)")

    @property
    def stored(self) -> str:
        """How the weight is stored: the format without its activation quantization."""
        return STORED_AS.get(self.format, self.format)

    @property
    def code(self) -> int:
        return FORMAT_CODES[self.format]

    @property
    def nbytes(self) -> int:
        """Bytes a forward streams for this weight."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.data, self.scale, self.minimum)
            if t is not None
        )

    def dequantized(self) -> torch.Tensor:
        """The weight as the kernels see it, dense. # [N, K] float32 (bfloat16 stays bfloat16)"""
        if self.format in ("float32", "bfloat16"):
            return self.data
        plain = self.row_major()
        if plain.format == "int8":
            scale = plain.scale.repeat_interleave(plain.group, dim=1)[:, : plain.in_features]
            return plain.data.float() * scale
        low = (plain.data & 0x0F).float()  # [N, blocks, 16]: elements 0-15 of each block
        high = (plain.data >> 4).float()  # elements 16-31
        codes = torch.cat((low, high), dim=-1)  # [N, blocks, 32]
        dense = (codes * plain.scale[..., None]) + plain.minimum[..., None]
        return dense.reshape(plain.out_features, plain.in_features)

    def output_rows(self, start: int, stop: int) -> KernelWeight:
        """Output rows [start, stop) as a weight of their own: views of the codes and scales (an
        interleaved weight's rows must start and stop at groups of 16, or stop at its end)."""
        if not 0 <= start <= stop <= self.out_features:
            raise ValueError(f"rows [{start}, {stop}) outside [0, {self.out_features})")
        rows = dict(out_features=stop - start)
        if self.format not in STORED_AS:
            return dataclasses.replace(
                self,
                data=self.data[start:stop],
                scale=None if self.scale is None else self.scale[start:stop],
                minimum=None if self.minimum is None else self.minimum[start:stop],
                **rows,
            )
        if start % COLUMN_GROUP or (stop % COLUMN_GROUP and stop != self.out_features):
            raise ValueError(
                f"{self.format} rows are interleaved by {COLUMN_GROUP}: [{start}, {stop}) does not "
                "fall on groups"
            )
        groups = slice(start // COLUMN_GROUP, -(-stop // COLUMN_GROUP))
        return dataclasses.replace(
            self,
            data=self.data[groups],
            scale=self.scale[groups],
            minimum=None if self.minimum is None else self.minimum[groups],
            **rows,
        )

    def row_major(self, rows: torch.Tensor | None = None) -> KernelWeight:
        """The weight in its stored format's plain layout (an interleaved one's undone; the
        others as they are), of output rows ``rows`` only if given (int64 [N'], each in
        [0, N): only those rows are copied)."""
        if self.format not in STORED_AS and rows is None:
            return self
        if self.format not in STORED_AS:
            minimum = None if self.minimum is None else self.minimum[rows].contiguous()
            return dataclasses.replace(
                self,
                data=self.data[rows].contiguous(),
                out_features=rows.numel(),
                scale=self.scale[rows].contiguous(),
                minimum=minimum,
            )
        n, blocks = self.out_features, self.in_features // ACTIVATION_BLOCK
        runs = _interleaved_runs(self.stored)
        if rows is None:
            rows = torch.arange(n)
        # [G, blocks, runs, 16 columns, 4 bytes] -> [N', blocks, runs, 4]: row r is column
        # r % 16 of group r // 16
        data = self.data.view(-1, blocks, runs, COLUMN_GROUP, 4)
        data = data[rows // COLUMN_GROUP, :, :, rows % COLUMN_GROUP]
        data = data.reshape(rows.numel(), blocks, runs * 4)
        if self.stored == "int8":
            data = data.reshape(rows.numel(), self.in_features)
        # Indexed by `rows`: new tensors, [N', R] each.
        minimum = None if self.minimum is None else column_table(self.minimum, n)[rows]
        return dataclasses.replace(
            self,
            format=self.stored,
            data=data.contiguous(),
            out_features=rows.numel(),
            scale=column_table(self.scale, n)[rows],
            minimum=minimum,
        )


def activations_int8(weight: KernelWeight) -> KernelWeight:
    """The same stored weight computing with int8 activations (``int8`` -> ``int8_a8``,
    ``q4_1`` -> ``q4_1_a8``), interleaved; a weight already so is returned as it is."""
    return integer_activations(weight, "_a8")


def activations_int24(weight: KernelWeight) -> KernelWeight:
    """The same stored weight computing with each block of 32 activations as 24-bit integers
    under a power-of-two scale (``int8`` -> ``int8_a24``, ``q4_1`` -> ``q4_1_a24``): float32-grade
    activations through integer dot products (three int8 digits), interleaved."""
    return integer_activations(weight, "_a24")


def integer_activations(weight: KernelWeight, suffix: str) -> KernelWeight:
    """``weight`` computing with integer activations of kind ``suffix`` (``ACTIVATION_SUFFIXES``):
    a plain int8 / q4_1 weight interleaved, an interleaved one relabelled (the same layout)."""
    if suffix not in ACTIVATION_SUFFIXES:
        raise ValueError(f"integer activations are one of {ACTIVATION_SUFFIXES}, got {suffix!r}")
    if weight.format in STORED_AS:
        return dataclasses.replace(weight, format=weight.stored + suffix)
    if weight.format not in ("int8", "q4_1"):
        raise ValueError(f"int8 activations need int8 or q4_1 weights, got {weight.format}")
    _check_int8_activations(weight.format + suffix, weight.in_features, weight.group)
    if weight.format == "int8" and bool((weight.data == -128).any()):
        # AVX2 multiplies magnitudes by signs: -128 has no positive counterpart in int8.
        raise ValueError(f"int8{suffix} needs int8 codes in [-127, 127]; this weight has -128")
    return interleave(weight, suffix)


def activation_suffix(format: str) -> str:
    """The suffix of an integer-activation format ("_a8" or "_a24"); "" for the others."""
    return next((s for s in ACTIVATION_SUFFIXES if format.endswith(s)), "")


def interleave(weight: KernelWeight, suffix: str = "_a8") -> KernelWeight:
    """A q4_1 or int8 weight as q4_1_a8 / int8_a8 (or ``suffix`` ``_a24``): for each group of 16
    output columns and each block of 32 codes, the codes cut into runs of 4 elements (Q4_1: 4
    bytes = 4 elements in the low nibbles, 4 more in the high ones), run t of columns 0-15 side
    by side in 64 bytes; scale and minimum grouped the same way (``grouped_table``). The last
    group is padded with zero columns."""
    n, blocks = weight.out_features, weight.in_features // ACTIVATION_BLOCK
    groups = -(-n // COLUMN_GROUP)
    runs = _interleaved_runs(weight.format)
    data = torch.zeros(groups * COLUMN_GROUP, blocks * runs * 4, dtype=weight.data.dtype)
    data[:n] = weight.data.reshape(n, blocks * runs * 4)
    # [G, 16 columns, blocks, runs, 4 bytes] -> [G, blocks, runs, 16, 4]
    data = data.view(groups, COLUMN_GROUP, blocks, runs, 4).permute(0, 2, 3, 1, 4)
    minimum = None if weight.minimum is None else grouped_table(weight.minimum)
    return dataclasses.replace(
        weight,
        format=weight.format + suffix,
        data=data.reshape(groups, blocks, runs, 64).contiguous(),
        scale=grouped_table(weight.scale),
        minimum=minimum,
    )


def grouped_table(table: torch.Tensor) -> torch.Tensor:
    """A per-column table # [N, R] (scales or minimums, R per output column) grouped like the
    interleaved codes: column c of group g at [g, :, c]. # [ceil(N / 16), R, 16]"""
    n, r = table.shape
    padded = table.new_zeros(-(-n // COLUMN_GROUP) * COLUMN_GROUP, r)
    padded[:n] = table
    return padded.view(-1, COLUMN_GROUP, r).transpose(1, 2).contiguous()


def column_table(grouped: torch.Tensor, n: int) -> torch.Tensor:
    """``grouped_table`` undone: the table per output column. # [n, R]"""
    return grouped.transpose(1, 2).reshape(-1, grouped.shape[1])[:n]


def _grouped_shape(n: int, rows: int) -> tuple[int, int, int]:
    return (-(-n // COLUMN_GROUP), rows, COLUMN_GROUP)


def _interleaved_runs(stored: str) -> int:
    """64-byte runs per group of 16 columns and block of 32 codes: 4 of nibbles, 8 of int8."""
    return 4 if stored == "q4_1" else 8


def _check_int8_activations(format: str, k: int, group: int) -> None:
    if k % ACTIVATION_BLOCK:
        raise ValueError(
            f"{format}: int8 activations need in_features divisible by {ACTIVATION_BLOCK}, got {k}"
        )
    if format.startswith("int8_") and group < k and group % ACTIVATION_BLOCK:
        raise ValueError(
            f"{format} needs weight groups of a multiple of {ACTIVATION_BLOCK} (or the whole "
            f"row), got {group}"
        )


def _check_table(table: torch.Tensor | None, shape: tuple[int, ...], what: str) -> None:
    if table is None or table.dtype != torch.float32 or tuple(table.shape) != shape:
        got = "nothing" if table is None else f"{table.dtype} {list(table.shape)}"
        raise ValueError(f"{what} must be float32 {list(shape)}, got {got}")


def dense_weight(weight: torch.Tensor) -> KernelWeight:
    """A float32 or bfloat16 weight, read in place. # [N, K]"""
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(weight.dtype)
    if name is None:
        raise ValueError(f"dense kernel weights are float32 or bfloat16, got {weight.dtype}")
    n, k = weight.shape
    return KernelWeight(name, weight.detach().contiguous(), int(n), int(k))


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> KernelWeight:
    """Symmetric int8: scale = max |w| / 127 per ``group`` weights of a row (default: the whole
    row, i.e. per output channel); code = round(w / scale). # [N, K] -> int8 [N, K]"""
    n, k = weight.shape
    group = k if group is None else group
    dense = weight.detach().float()
    padded = -(-k // group) * group
    blocks = torch.nn.functional.pad(dense, (0, padded - k)).view(n, -1, group)
    scale = blocks.abs().amax(dim=-1) / 127.0  # [N, groups]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(blocks / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return KernelWeight(
        "int8",
        codes.view(n, padded)[:, :k].contiguous(),
        int(n),
        int(k),
        scale=scale.contiguous(),
        group=group,
    )


def quantize_q4_1(weight: torch.Tensor) -> KernelWeight:
    """Q4_1 of a dense weight: per block of 32, d = (max - min) / 15, m = min (both rounded to
    fp16, as a GGUF file stores them), code = round((w - m) / d) in 0..15. # [N, K]"""
    n, k = weight.shape
    if k % Q4_BLOCK:
        raise ValueError(f"q4_1 needs in_features divisible by 32, got {k}")
    blocks = weight.detach().float().view(n, k // Q4_BLOCK, Q4_BLOCK)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
    scale = ((high - low) / 15).half().float()
    minimum = low.half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (
        torch.round((blocks - minimum[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    )
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # [N, blocks, 16]
    return KernelWeight(
        "q4_1",
        packed.contiguous(),
        int(n),
        int(k),
        scale=scale.contiguous(),
        minimum=minimum.contiguous(),
        group=Q4_BLOCK,
    )
