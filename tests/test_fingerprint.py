"""Base-model fingerprints: equality, sensitivity, dtype stability, mismatch messages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHS, save_tiny_target
from transformers import PreTrainedModel

from selfspec.fingerprint import (
    BaseFingerprint,
    FingerprintMismatch,
    check_compatible,
    fingerprint_of,
)
from selfspec.target import TargetSpec, load_target

MakeModel = Callable[..., PreTrainedModel]


@pytest.mark.parametrize("arch", ARCHS)
def test_same_weights_same_fingerprint(tiny_model_factory: MakeModel, arch: str) -> None:
    first = fingerprint_of(tiny_model_factory(arch, seed=0))
    assert first == fingerprint_of(tiny_model_factory(arch, seed=0))
    assert first.hidden_size == 32
    assert first.vocab_size == 101
    assert first.num_layers == 2
    assert len(first.weights_hash) == 16


def test_different_weights_differ(tiny_model_factory: MakeModel) -> None:
    base = tiny_model_factory("qwen2", seed=0)
    assert fingerprint_of(base) != fingerprint_of(tiny_model_factory("qwen2", seed=1))
    with torch.no_grad():
        base.get_output_embeddings().weight[3, 0] += 0.5  # lm_head only (qwen2 is untied)
    untouched = fingerprint_of(tiny_model_factory("qwen2"))
    assert fingerprint_of(base).weights_hash != untouched.weights_hash


def test_stable_across_fp32_and_bf16_loads(tmp_path: Path) -> None:
    path = str(save_tiny_target(tmp_path / "tiny"))
    fp32 = fingerprint_of(load_target(TargetSpec(model=path, dtype="float32")).model)
    bf16 = fingerprint_of(load_target(TargetSpec(model=path, dtype="bfloat16")).model)
    assert fp32 == bf16


def test_unwraps_get_base_model(tiny_model_factory: MakeModel) -> None:
    model = tiny_model_factory("llama")

    class Wrapper(torch.nn.Module):  # stands in for a peft model
        def get_base_model(self) -> PreTrainedModel:
            return model

    assert fingerprint_of(Wrapper()) == fingerprint_of(model)


def test_dict_round_trip(tiny_model_factory: MakeModel) -> None:
    fingerprint = fingerprint_of(tiny_model_factory("gpt2"))
    assert fingerprint.architecture == "GPT2LMHeadModel"
    assert BaseFingerprint.from_dict(fingerprint.to_dict()) == fingerprint
    data = fingerprint.to_dict()
    del data["weights_hash"]
    with pytest.raises(ValueError, match="weights_hash"):
        BaseFingerprint.from_dict(data)
    with pytest.raises(ValueError, match="hidden_size"):
        replace(fingerprint, hidden_size=0)


def test_mismatch_names_both(tiny_model_factory: MakeModel) -> None:
    expected = fingerprint_of(tiny_model_factory("llama"))
    actual = replace(expected, hidden_size=64, weights_hash="0" * 16)
    check_compatible(expected, expected, "heads")
    with pytest.raises(FingerprintMismatch) as info:
        check_compatible(expected, actual, "heads at /tmp/h")
    message = str(info.value)
    assert "heads at /tmp/h" in message
    assert "hidden_size: expected 32, got 64" in message
    assert f"weights_hash: expected '{expected.weights_hash}', got '{'0' * 16}'" in message
    assert "vocab_size:" not in message.split("differs in")[1]
    assert isinstance(info.value, ValueError)
