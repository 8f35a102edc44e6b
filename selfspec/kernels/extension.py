"""Build the C++ kernels once per machine and load them; None, with one warning, where they can't.

The sources in ``csrc/`` are compiled by torch's ``cpp_extension`` (with ``ninja``) into the
cache (``$SELFSPEC_CACHE/kernels``), keyed by the sources, torch and Python versions: about a
minute the first time, an import afterwards. ``scripts/setup.sh`` builds them as part of the
install (``python -m selfspec.kernels.extension``). Nothing is built when ``selfspec`` is
imported, and a failed build never breaks an import: the callers fall back to pure torch.

Environment: ``SELFSPEC_KERNELS=torch`` never loads the extension (the pure-torch fallback, for
comparison and tests); ``SELFSPEC_KERNEL_ISA=avx2`` forces the AVX2 path on an AVX-512 CPU;
``SELFSPEC_KERNEL_AMX=0`` keeps the integer-activation formats off the AMX tiles, and
``SELFSPEC_KERNEL_BF16=0`` bf16 weights off AVX-512 BF16's dot products (the same bits either
way).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

from selfspec.paths import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "ops.cpp",
    "decoder_layer.cpp",
    "isa_avx512.cpp",
    "isa_avx2.cpp",
    "isa_amx.cpp",
    "isa_avx512bf16.cpp",
)
HEADERS = ("ops.h", "params.h", "body.h", "vec_avx512.h", "vec_avx2.h")
# -ffp-contract=off: no multiply-add fused behind our back, so every rounding is the one written.
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
ISA_ENV = "SELFSPEC_KERNEL_ISA"
BACKEND_ENV = "SELFSPEC_KERNELS"
ISAS = ("auto", "avx512", "avx2")
COMPLETE = "complete"  # written into a build directory once its module has loaded


class KernelError(RuntimeError):
    """The kernels were asked for explicitly and cannot run here; the message says why."""


def requested_isa() -> str:
    """The instruction-set path asked for through ``SELFSPEC_KERNEL_ISA`` ("auto" if unset)."""
    isa = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if isa not in ISAS:
        raise KernelError(f"{ISA_ENV}={isa!r} is not one of {ISAS}")
    return isa


def disabled_by_environment() -> bool:
    return os.environ.get(BACKEND_ENV, "").strip().lower() in ("torch", "off", "0", "false")


def build_key() -> str:
    """Hash of everything the compiled module depends on."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:12]


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels, built on first use; None where they can't be built or run."""
    if disabled_by_environment():
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _warn_fallback(f"the C++ kernels are written for x86-64, this is {platform.machine()}")
        return None
    key = build_key()
    build_dir = cache_root() / "kernels" / f"small_m-{key}"
    try:
        module = _built(build_dir, key) or _build(build_dir, key)
    except Exception as err:  # a missing compiler or ninja, a compile error: fall back, say so
        _warn_fallback(f"building them failed: {str(err).strip().splitlines()[-1:]}")
        return None
    if not module.supported_isas():
        _warn_fallback("this CPU has neither AVX2 with FMA nor AVX-512")
        return None
    return module


def _built(build_dir: Path, key: str) -> ModuleType | None:
    """The module a finished build left (its ``complete`` marker written after it loaded once),
    imported directly: no compiler, no lock. The key hashes the sources, so it is this build."""
    library = build_dir / f"selfspec_small_m_{key}.so"
    if not (build_dir / COMPLETE).exists() or not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"selfspec_small_m_{key}", library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(build_dir: Path, key: str) -> ModuleType:
    """Compile (or finish compiling) under an OS lock that dies with its process. torch's own
    lock file is a plain file that a killed build leaves behind, after which every later load
    would wait on it forever: held under our lock, any such file is stale and removed."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the OS if this process dies
        if (build_dir / "lock").exists():
            logger.warning(
                "removing a stale kernel build lock left by a killed build: %s", build_dir
            )
            (build_dir / "lock").unlink()
        module = cpp_extension.load(
            name=f"selfspec_small_m_{key}",
            sources=[str(CSRC / name) for name in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
        (build_dir / COMPLETE).touch()
    return module


def active_isa() -> str | None:
    """The path the kernels run on here ("avx512" or "avx2"), or None on the torch fallback."""
    module = load()
    if module is None:
        return None
    isa = requested_isa()
    supported = list(module.supported_isas())
    if isa == "auto":
        return supported[0]
    if isa not in supported:
        raise KernelError(f"{ISA_ENV}={isa} asked for, but this CPU runs only {supported}")
    return isa


def integer_activations_pay() -> bool:
    """Whether float32's 24-bit integer activations (``TargetSpec.activations="int24"``) decode
    faster here than float ones: wherever the C++ kernels run their integer dot products on the
    same path as their float ones, i.e. the AVX-512 path with VNNI, or the AVX2 path (measured on
    an AVX2-only EPYC: a 1-token forward 0.76x the float one, 16 rows about equal, decoding
    1.07-1.14x faster end to end). Not where AVX-512 lacks VNNI: there the integer formats fall
    back to AVX2's half-width ``maddubs`` while floats run AVX-512."""
    module = load()
    if module is None:
        return False
    return active_isa() == "avx2" or bool(module.vnni_ready())


def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f"selfspec's C++ kernels are not available ({reason}); using the pure-torch fallback, "
        "which is exact but slower",
        RuntimeWarning,
        stacklevel=3,
    )


def main() -> None:
    """Build now (``scripts/setup.sh``) rather than on the first generation."""
    built = load()
    paths = f"built, paths {built.supported_isas()}" if built else "not built: the torch fallback"
    if built and built.amx_ready():
        paths += " + AMX tiles (int8_a8 and the *_a24 formats from 8 rows, q4_1_a8 from 12)"
    if built and built.bf16_dot_ready():
        paths += " + AVX-512 BF16 dot products (bf16 weights)"
    print(f"selfspec kernels: {paths}")


if __name__ == "__main__":
    main()
