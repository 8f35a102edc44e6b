"""The target's numeric modes, named once for `TargetSpec` and every CLI (no torch import here,
so `selfspec --help` stays fast)."""

from __future__ import annotations

DTYPE_NAMES = ("float32", "bfloat16", "int8", "int4")
DTYPE_HELP = (
    "float32 (the default, exact mode) | bfloat16 | int8 (weight-only, per channel) | int4 "
    "(weight-only 4-bit Q4_1 blocks; for the default model the GGUF file's own weights). In "
    "every mode speculative output equals vanilla output token for token"
)
KERNELS_HELP = (
    "run linear layers and attention through selfspec's row-invariant kernels (default: on, "
    "the C++ kernels where they build, else a pure-torch fallback); --no-kernels: "
    "transformers' own ops (float32 and bfloat16 only)"
)


def check_dtype(dtype: str, flag: str = "--dtype") -> None:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"{flag} must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
