"""Packed linear weights (oneDNN): same results as F.linear, same modules to peft and the LoRA bank,
repacked when the weight changes, plain F.linear whenever autograd or another dtype is involved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_drafter import OracleDrafter
from peft import LoraConfig, get_peft_model
from tiny_models import VOCAB_SIZE, make_tiny_model, save_tiny_target
from torch import nn

import selfspec.target as target_module
from selfspec.cost_curve import _machine_key
from selfspec.fingerprint import fingerprint_of
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for, load_heads, save_heads
from selfspec.heads.draft_vocab import set_draft_vocab
from selfspec.packed_linear import (
    PackedLinear,
    is_packed,
    pack_linears,
    packing_available,
    unpack_linears,
)
from selfspec.target import TargetLoadError, TargetSpec, load_target
from selfspec.target_forward import TargetForward
from selfspec.tree import DynamicTree, StaticTree

needs_bf16 = pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason="no oneDNN bf16 packed linear on this CPU"
)
needs_fp32 = pytest.mark.skipif(
    not packing_available(torch.float32), reason="no oneDNN in this torch build"
)


def _linear(
    in_features: int, out_features: int, dtype: torch.dtype, bias: bool = True
) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype).requires_grad_(False)


@needs_bf16
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_results_equal_f_linear_bit_for_bit_and_by_row(bias: bool) -> None:
    layer = _linear(96, 160, torch.bfloat16, bias)
    x = torch.randn(2, 12, 96).to(torch.bfloat16)  # [batch, rows, in]
    with torch.no_grad():
        expected = nn.functional.linear(x, layer.weight, layer.bias)
        assert pack_linears(layer) == 1
        assert type(layer) is PackedLinear and isinstance(layer, nn.Linear)
        packed = layer(x)
        rows_alone = torch.cat([layer(x[:, i : i + 1]) for i in range(12)], dim=1)
    assert torch.equal(packed, expected)
    assert torch.equal(rows_alone, packed)  # a row's result does not depend on its neighbours


@needs_fp32
def test_float32_packed_is_close_to_f_linear() -> None:
    layer = _linear(64, 48, torch.float32)
    x = torch.randn(5, 64)
    expected = nn.functional.linear(x, layer.weight, layer.bias)
    pack_linears(layer)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected)


@needs_bf16
def test_weight_changes_are_seen() -> None:
    layer = _linear(32, 16, torch.bfloat16)
    pack_linears(layer)
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: the version counter moves
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
        layer.weight = nn.Parameter(torch.randn(16, 32).to(torch.bfloat16), requires_grad=False)
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


@needs_bf16
def test_autograd_and_other_dtypes_take_f_linear() -> None:
    layer = _linear(32, 16, torch.bfloat16)
    pack_linears(layer)
    x = torch.randn(3, 32).to(torch.bfloat16).requires_grad_(True)
    layer(x).float().sum().backward()  # the packed kernel has no backward; F.linear does
    assert x.grad is not None and x.grad.shape == x.shape
    with torch.no_grad():
        mismatched = torch.randn(3, 32)  # float32 input on a bf16 layer: F.linear's own error
        with pytest.raises(RuntimeError):
            layer(mismatched)


@needs_bf16
def test_unpack_restores_plain_linears_and_state_dict() -> None:
    model = make_tiny_model("llama").to(torch.bfloat16)
    keys = list(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == linears and is_packed(model)
    assert list(model.state_dict()) == keys  # the packed copy is not a parameter or buffer
    assert unpack_linears(model) == linears and not is_packed(model)
    assert all(not hasattr(m, "_packed") for m in model.modules())


@needs_bf16
def test_peft_lora_wraps_packed_layers_unchanged() -> None:
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    outputs = []
    for pack in (False, True):
        model = make_tiny_model("llama").to(torch.bfloat16)
        if pack:
            pack_linears(model)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        torch.manual_seed(0)  # lora_A's random init
        lora = get_peft_model(model, config)
        with torch.no_grad():
            for name, param in lora.named_parameters():
                if "lora_B" in name:
                    torch.manual_seed(len(name))
                    param.copy_(torch.randn(param.shape) * 0.5)
            outputs.append(lora(ids).logits)
    assert torch.equal(outputs[0], outputs[1])


@needs_bf16
def test_without_kernels_bf16_is_packed_by_default_and_float32_is_not(tmp_path: Path) -> None:
    directory = save_tiny_target(tmp_path / "tiny-llama")
    torch_ops = {"model": str(directory), "kernels": False}
    assert is_packed(load_target(TargetSpec(dtype="bfloat16", **torch_ops)).model)
    assert not is_packed(load_target(TargetSpec(**torch_ops)).model)
    off = TargetSpec(dtype="bfloat16", packed_weights=False, **torch_ops)
    assert not is_packed(load_target(off).model)
    # With the kernels (the default) nothing is packed: the kernels read the weights themselves.
    assert not is_packed(load_target(TargetSpec(model=str(directory), dtype="bfloat16")).model)
    with pytest.raises(ValueError, match="packed_weights=True"):
        TargetSpec(model=str(directory), packed_weights=True)


def test_packing_asked_for_where_impossible_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = save_tiny_target(tmp_path / "tiny-llama")
    monkeypatch.setattr(target_module, "packing_available", lambda dtype: False)
    with pytest.raises(TargetLoadError, match="packed weights"):
        load_target(TargetSpec(model=str(directory), packed_weights=True, kernels=False))
    # Automatic packing quietly stays off.
    spec = TargetSpec(model=str(directory), dtype="bfloat16", kernels=False)
    assert not is_packed(load_target(spec).model)


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_invalid_packed_weights_value(value: object) -> None:
    with pytest.raises(ValueError, match="packed_weights"):
        TargetSpec(packed_weights=value)  # type: ignore[arg-type]


@needs_fp32
def test_heads_and_draft_rows_follow_a_packed_target_and_speculation_stays_lossless(
    tmp_path: Path,
) -> None:
    """float32 packed on request: vanilla and EAGLE speculation (draft vocabulary, dynamic tree)
    through the packed target agree token for token with the unpacked vanilla loop."""
    prompt = [1, 23, 5, 61, 8, 30]
    config = GenerationConfig(max_new_tokens=20, speculate=False, stop_token_ids=())
    model = make_tiny_model("llama")
    with torch.no_grad():  # livelier weights than the default init, so outputs are not constant
        generator = torch.Generator().manual_seed(7)
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    longer = GenerationConfig(max_new_tokens=25, speculate=False, stop_token_ids=())
    known = SpeculativeGenerator(model).generate(prompt, longer).token_ids  # the oracle's
    expected = known[:20]
    heads = build_heads(heads_config_for(model, "eagle", draft_vocab_size=60))
    set_draft_vocab(heads, torch.arange(0, 101, 101 / 60).long()[:60])
    with torch.no_grad():
        for param in heads.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    save_heads(heads, tmp_path / "heads", fingerprint_of(model))
    pack_linears(model)
    loaded = load_heads(tmp_path / "heads", model)
    assert is_packed(loaded)
    assert type(SpeculativeGenerator(model, loaded).drafter.projection.rows) is PackedLinear
    speculative = SpeculativeGenerator(model, loaded)
    assert speculative.generate(prompt, config).token_ids == expected
    tree = DynamicTree(top_k=3, depth=3, budget=8)
    result = speculative.generate(
        prompt, GenerationConfig(max_new_tokens=20, tree=tree, stop_token_ids=())
    )
    assert result.token_ids == expected
    # Accepted paths (and their KV commits) through the packed target: an oracle drafts the known
    # continuation at rank 1, 0, 1 among siblings (non-contiguous accepted paths).
    oracle = SpeculativeGenerator(model)
    oracle.drafter = OracleDrafter(known, VOCAB_SIZE, correct_rank=(1, 0, 1))
    tree = StaticTree.full((2, 2, 2))
    result = oracle.generate(
        prompt, GenerationConfig(max_new_tokens=20, tree=tree, stop_token_ids=())
    )
    assert result.token_ids == expected
    assert result.stats.tau == tree.depth + 1


@needs_bf16
def test_cost_curve_cache_key_tells_packed_from_unpacked() -> None:
    model = make_tiny_model("llama").to(torch.bfloat16)
    unpacked = _machine_key(TargetForward(model), (1, 2))
    pack_linears(model)
    assert _machine_key(TargetForward(model), (1, 2)) != unpacked
