"""Fixtures for the kernel tests: which paths run here (each C++ instruction-set path the CPU
supports, and the pure-torch fallback), selected per test through the environment."""

from __future__ import annotations

import pytest

from selfspec.kernels import extension


def cpp_paths() -> list[str]:
    module = extension.load()
    return list(module.supported_isas()) if module is not None else []


PATHS = [*cpp_paths(), "torch"]


@pytest.fixture(params=PATHS)
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on one path: "avx512" / "avx2" (forced through SELFSPEC_KERNEL_ISA, so the
    AVX2 path runs on an AVX-512 CPU too) or "torch" (the extension hidden)."""
    path = request.param
    if path == "torch":
        monkeypatch.setattr(extension, "load", lambda: None)
    else:
        monkeypatch.setenv(extension.ISA_ENV, path)
    return path
