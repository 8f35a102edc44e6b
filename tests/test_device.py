"""The device option, checked without a GPU: what is refused, where "auto" goes, the CLI flags.

``torch.cuda.is_available`` is patched where a test needs a GPU to be seen; nothing here moves a
tensor to one (tests/test_cuda.py does that, where a GPU exists).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_target

from selfspec.cli_generate import GenerateArgs
from selfspec.cli_generate import main as generate_main
from selfspec.kernels.modules import uses_kernels
from selfspec.target import TargetLoadError, TargetSpec, load_target


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """``gpus(n)``: torch reports n GPUs (0: none), without touching a driver."""

    def see(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    return see


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "cuda:0:1", ""])
def test_an_unknown_device_is_refused_naming_the_option(device: str) -> None:
    with pytest.raises(ValueError, match=r"TargetSpec\.device must be auto, cpu, cuda or cuda:N"):
        TargetSpec(device=device)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"dtype": "int8"}, "dtype 'int8'"),
        ({"dtype": "int4"}, "dtype 'int4'"),
        ({"kernels": True}, "kernels=True"),
        ({"kernels": False, "packed_weights": True}, "packed_weights=True"),
    ],
)
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cpu_only_modes_are_refused_on_cuda(device: str, options: dict, named: str) -> None:
    with pytest.raises(ValueError, match=rf"device='{device}' does not run {named}"):
        TargetSpec(device=device, **options)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernels", [None, False])
def test_float_modes_are_allowed_on_cuda(dtype: str, kernels: bool | None) -> None:
    spec = TargetSpec(device="cuda:0", dtype=dtype, kernels=kernels)
    # transformers' ops there: never oneDNN-packed weights, which are CPU code too
    assert not spec.wants_packing(torch.device("cuda", 0))


def test_cpu_is_the_default_and_stays_the_cpu(gpus) -> None:
    gpus(1)
    assert TargetSpec().device == "cpu"
    assert TargetSpec().resolve_device() == torch.device("cpu")


def test_auto_is_the_cpu_without_a_gpu(gpus) -> None:
    gpus(0)
    assert TargetSpec(device="auto").resolve_device() == torch.device("cpu")


def test_auto_is_the_gpu_where_torch_sees_one(gpus) -> None:
    gpus(2)
    assert TargetSpec(device="auto").resolve_device() == torch.device("cuda", 0)
    assert TargetSpec(device="cuda").resolve_device() == torch.device("cuda", 0)
    assert TargetSpec(device="cuda:1").resolve_device() == torch.device("cuda", 1)


@pytest.mark.parametrize("options", [{"dtype": "int4"}, {"kernels": True}])
def test_auto_keeps_cpu_only_modes_on_the_cpu_and_says_so(
    gpus, caplog: pytest.LogCaptureFixture, options: dict
) -> None:
    gpus(1)
    with caplog.at_level(logging.WARNING, logger="selfspec.target"):
        assert TargetSpec(device="auto", **options).resolve_device() == torch.device("cpu")
    assert "a GPU is present, but" in caplog.text


def test_cuda_without_a_gpu_is_a_load_error_before_anything_loads(
    gpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(0)
    monkeypatch.setattr("selfspec.target._load_hf_dir", _never)
    with pytest.raises(TargetLoadError, match=r"device 'cuda' was asked for, but torch .* no GPU"):
        load_target(TargetSpec(model=str(tmp_path), device="cuda"))


def test_a_gpu_index_beyond_the_gpus_is_a_load_error(gpus) -> None:
    gpus(1)
    with pytest.raises(TargetLoadError, match=r"torch sees 1 GPU\(s\), cuda:0 to cuda:0"):
        TargetSpec(device="cuda:1").resolve_device()


def test_auto_loads_here_as_the_cpu_default_does(gpus, tmp_path: Path) -> None:
    gpus(0)
    directory = save_tiny_target(tmp_path / "tiny-llama")
    auto = load_target(TargetSpec(model=str(directory), device="auto"))
    cpu = load_target(TargetSpec(model=str(directory)))
    assert auto.device == cpu.device == torch.device("cpu")
    assert uses_kernels(auto.model) and uses_kernels(cpu.model)  # kernels=None: on, on the CPU
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.inference_mode():
        assert torch.equal(auto.model(ids).logits, cpu.model(ids).logits)


# -- the CLIs' shared target options ---------------------------------------------------------


def test_generate_takes_a_device_and_passes_it_to_the_target() -> None:
    args = GenerateArgs(prompt="hi", device="cuda:1", dtype="bfloat16")
    spec = args.target_spec()
    assert (spec.device, spec.dtype, spec.kernels) == ("cuda:1", "bfloat16", None)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"device": "gpu"}, "--device must be auto, cpu, cuda or cuda:N"),
        ({"device": "cuda", "dtype": "int8"}, "--device cuda does not run dtype 'int8'"),
        ({"device": "cuda", "kernels": True}, "--device cuda does not run kernels=True"),
        ({"dtype": "float16"}, "--dtype must be one of"),
    ],
)
def test_generate_refuses_bad_target_options_naming_the_flag(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GenerateArgs(prompt="hi", **options)


def test_generate_on_a_missing_gpu_exits_with_the_reason(
    gpus, capsys: pytest.CaptureFixture
) -> None:
    gpus(0)
    assert generate_main(["--prompt", "hi", "--device", "cuda", "--no-speculation"]) == 2
    assert "selfspec generate: error: device 'cuda' was asked for" in capsys.readouterr().err


def _never(*args: object) -> None:
    raise AssertionError("the target was loaded although its device does not exist")


def test_narrowing_the_draft_vocabulary_keeps_the_heads_dtype_and_device() -> None:
    """with_draft_vocab rebuilds the heads (float32, on the CPU) when the size changes; the
    rebuilt heads go back where the given ones were, as they were."""
    from tiny_models import make_tiny_model

    from selfspec.heads import build_heads, heads_config_for
    from selfspec.heads.draft_vocab import with_draft_vocab

    model = make_tiny_model("llama")
    heads = build_heads(heads_config_for(model, "eagle")).to(torch.bfloat16)
    narrowed = with_draft_vocab(heads, torch.arange(2, 60))
    assert {p.dtype for p in narrowed.parameters()} == {torch.bfloat16}
    assert {t.device for t in [*narrowed.parameters(), *narrowed.buffers()]} == {
        torch.device("cpu")
    }
