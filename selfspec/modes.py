"""The target's numeric modes, named once for `TargetSpec` and every CLI (no torch import here,
so `selfspec --help` stays fast)."""

from __future__ import annotations

DTYPE_NAMES = ("float32", "bfloat16", "int8", "int4", "w4a8")
DTYPE_HELP = (
    "float32 (the default, exact mode) | bfloat16 | int8 (weight-only, per channel) | int4 "
    "(weight-only 4-bit Q4_1 blocks; for the default model the GGUF file's own weights) | w4a8 "
    "(int4's weights with activations quantized to int8 per block of 32: integer dot products "
    "as llama.cpp computes, lossy, cheaper trees). In every mode speculative output equals "
    "vanilla output token for token"
)
ACTIVATION_NAMES = ("auto", "float", "int24")
ACTIVATIONS_HELP = (
    "float32 from a GGUF file's quantized blocks: float (each block dequantized, fp32 "
    "multiply-adds: the dense fp32 results bit for bit) | int24 (each block of 32 activations as "
    "24-bit integers under a power-of-two scale, integer dot products: float32-grade, faster "
    "on the AVX2 path and where AVX-512 has VNNI) | auto (the default: int24 where it is "
    "faster, else float). Speculation is exact either way"
)


def check_activations(
    activations: str, dtype: str, kernels: bool | None, flag: str = "--activations"
) -> None:
    """``activations`` is one of ``ACTIVATION_NAMES``, and "int24" comes with float32 through
    the kernels (it is float32's arithmetic there)."""
    if activations not in ACTIVATION_NAMES:
        raise ValueError(
            f"{flag} must be one of {', '.join(ACTIVATION_NAMES)}, got {activations!r}"
        )
    if activations == "int24" and (dtype != "float32" or kernels is False):
        raise ValueError(
            f"{flag} 'int24' is float32's arithmetic through the kernels (dtype float32, "
            f"kernels not off); got dtype {dtype!r}, kernels {kernels!r}"
        )


KERNELS_HELP = (
    "run linear layers and attention through selfspec's row-invariant kernels (default: on, "
    "the C++ kernels where they build, else a pure-torch fallback); --no-kernels: "
    "transformers' own ops (float32 and bfloat16 only)"
)


def check_dtype(dtype: str, flag: str = "--dtype") -> None:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"{flag} must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")


def split_mode(mode: str) -> tuple[str, str]:
    """A benchmark's mode name, a dtype with float32's activations after a colon
    ("float32:int24", "float32:float") or a dtype alone (activations "auto"), as (dtype,
    activations), both checked."""
    dtype, _, activations = mode.partition(":")
    activations = activations or "auto"
    check_dtype(dtype, "mode")
    check_activations(activations, dtype, None, "mode")
    return dtype, activations


DEVICE_NAMES = ("auto", "cpu", "cuda")
DEVICE_HELP = (
    "where the target runs: cpu (the default) | cuda | cuda:N | auto (cuda when torch sees a GPU "
    "and the mode runs there, else cpu). On cuda: float32 or bfloat16 with transformers' ops "
    "(the row-invariant kernels, and so int8 / int4 / w4a8, are CPU-only); speculative output "
    "there equals vanilla up to float noise, not bit for bit"
)


def check_device(device: str, flag: str = "--device") -> None:
    """`device` is "auto", "cpu", "cuda" or "cuda:N" (N >= 0); whether it exists is checked at
    load (`selfspec.target.TargetSpec.resolve_device`)."""
    if isinstance(device, str):
        kind, sep, index = device.partition(":")
        if (not sep and kind in DEVICE_NAMES) or (
            kind == "cuda" and index.isascii() and index.isdigit()
        ):
            return
    raise ValueError(f"{flag} must be auto, cpu, cuda or cuda:N (N a GPU index), got {device!r}")


def cpu_only_reason(
    dtype: str,
    kernels: bool | None,
    packed_weights: bool | None = None,
    activations: str = "auto",
) -> str | None:
    """What of a target's options runs on the CPU only (named for an error), or None."""
    if dtype in ("int8", "int4", "w4a8"):
        return f"dtype {dtype!r} (it computes through the C++ CPU kernels)"
    if activations == "int24":
        return "activations 'int24' (it computes through the C++ CPU kernels)"
    if kernels is True:
        return "kernels=True (the row-invariant kernels are CPU code)"
    if packed_weights is True:
        return "packed_weights=True (oneDNN's CPU weight packing)"
    return None
