"""LeanBody: the HF decoder body's results bit for bit (torch.equal), caches included, for every
call shape decoding makes (prompt, one token, tree, batched trees), with packed weights and LoRA;
everything it does not cover goes to the HF body."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import VOCAB_SIZE, make_tiny_model, tiny_config
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache

from selfspec.cost_curve import _machine_key
from selfspec.lean_body import LeanBody, unsupported_reason
from selfspec.packed_linear import pack_linears, packing_available
from selfspec.target_forward import TargetForward

LEAN_ARCHS = ("llama", "qwen2", "mistral")
DTYPES = [torch.float32, torch.bfloat16]


def _tree_mask(parents: list[int], cache_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Float mask of a tree over cache + tree: a node sees the cache, itself and its ancestors.
    # [1, 1, T, cache + T]"""
    size = len(parents)
    allowed = torch.zeros(size, cache_len + size, dtype=torch.bool)
    allowed[:, :cache_len] = True
    for node in range(size):
        ancestor = node
        while ancestor >= 0:
            allowed[node, cache_len + ancestor] = True
            ancestor = parents[ancestor]
    blocked = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype)
    return torch.where(allowed, torch.zeros((), dtype=dtype), blocked)[None, None]


PARENTS = [-1, 0, 0, 1, 1, 2, 3]  # a 7-node tree, depths 0, 1, 1, 2, 2, 2, 3
DEPTHS = [0, 1, 1, 2, 2, 2, 3]


def _run_steps(model: nn.Module, lean: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """Through ``TargetForward(model, lean=lean)``: a prompt, one token, a tree, one token over
    the tree's cache, then one token as a one-node tree (with a mask, as the vanilla loop runs
    it): every output and the final cache's keys and values."""
    target = TargetForward(model, lean=lean)
    assert (target.lean is not None) == lean
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB_SIZE, (1, 9), generator=generator)
    step = torch.randint(3, VOCAB_SIZE, (1, 1), generator=generator)
    tree = torch.randint(3, VOCAB_SIZE, (1, len(PARENTS)), generator=generator)
    cache = target.new_cache()
    outputs = [target.features(prompt, torch.arange(9)[None], cache)]
    outputs.append(target.features(step, torch.tensor([[9]]), cache))
    mask = _tree_mask(PARENTS, 10, dtype)
    positions = torch.tensor([DEPTHS]) + 10
    outputs.append(target.features(tree, positions, cache, mask))
    outputs.append(target.features(step, torch.tensor([[14]]), cache))
    root_only = _tree_mask([-1], 18, dtype)
    outputs.append(target.features(step, torch.tensor([[15]]), cache, root_only))
    for layer in cache.layers:
        outputs += [layer.keys, layer.values]
    return outputs


def _assert_all_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, index
        assert torch.equal(a, b), f"output {index} differs by {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_bit_identical_to_the_hf_body(arch: str, dtype: torch.dtype) -> None:
    model = make_tiny_model(arch).to(dtype)
    with torch.inference_mode():
        _assert_all_equal(_run_steps(model, True, dtype), _run_steps(model, False, dtype))


@pytest.mark.skipif(not packing_available(torch.bfloat16), reason="no oneDNN bf16 packing here")
@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_bit_identical_with_packed_weights(arch: str) -> None:
    model = make_tiny_model(arch).to(torch.bfloat16)
    assert pack_linears(model) > 0
    with torch.inference_mode():
        _assert_all_equal(
            _run_steps(model, True, torch.bfloat16), _run_steps(model, False, torch.bfloat16)
        )


@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_bit_identical_under_a_peft_lora_adapter(arch: str) -> None:
    model = make_tiny_model(arch)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # lora_B starts at zero: make the adapter change the output
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    peft_model.eval()
    with torch.inference_mode():
        adapted = _run_steps(peft_model, True, torch.float32)
        _assert_all_equal(adapted, _run_steps(peft_model, False, torch.float32))
        with peft_model.disable_adapter():
            base = _run_steps(peft_model, True, torch.float32)
    assert not torch.equal(adapted[0], base[0])  # the adapter was applied on the lean path


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_trees_bit_identical(dtype: torch.dtype) -> None:
    model = make_tiny_model("llama").to(dtype)
    generator = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, VOCAB_SIZE, (2, 6), generator=generator)
    tree = torch.randint(3, VOCAB_SIZE, (2, 4), generator=generator)
    mask = torch.cat(  # row 0 sees only 4 of the 6 cached entries (a shorter request)
        [_tree_mask([-1, 0, 0, 1], 6, dtype), _tree_mask([-1, 0, 1, 2], 6, dtype)]
    )
    mask[0, 0, :, 4:6] = torch.finfo(dtype).min
    positions = torch.tensor([[4, 5, 5, 6], [6, 7, 8, 9]])
    results = []
    with torch.inference_mode():
        for lean in (True, False):
            target = TargetForward(model, lean=lean)
            cache = target.new_cache()
            target.features(prefix, torch.arange(6).expand(2, 6), cache)
            results.append([target.features(tree, positions, cache, mask), *cache.layers[0].keys])
    _assert_all_equal(results[0], results[1])


def test_the_lean_path_is_the_one_taken() -> None:
    model = make_tiny_model("llama")
    calls = []
    model.model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        TargetForward(model).features(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], cache)
        assert calls == []  # the HF decoder layers were not called
        TargetForward(model, lean=False).features(torch.tensor([[8]]), torch.tensor([[3]]), cache)
    assert calls == [1]


def test_unsupported_bodies_are_named_and_left_to_transformers() -> None:
    gpt2 = make_tiny_model("gpt2")
    assert "gpt2" in unsupported_reason(gpt2.get_decoder())
    assert TargetForward(gpt2).lean is None
    with pytest.raises(ValueError, match="gpt2"):
        LeanBody(gpt2.get_decoder())

    config = tiny_config("mistral")
    config.sliding_window = 4
    windowed = AutoModelForCausalLM.from_config(config)
    assert "sliding" in unsupported_reason(windowed.get_decoder())
    assert TargetForward(windowed).lean is None

    assert TargetForward(make_tiny_model("llama"), lean=False).lean is None


def test_calls_it_does_not_cover_go_to_the_hf_body() -> None:
    model = make_tiny_model("llama")
    lean = LeanBody(model.get_decoder())
    cache = DynamicCache(config=model.config)
    several, one = torch.tensor([[5, 6, 7]]), torch.tensor([[5]])
    assert lean.covers(several, cache, None)  # a prompt over an empty cache
    with torch.inference_mode():
        TargetForward(model).features(several, torch.arange(3)[None], cache)
    assert lean.covers(one, cache, None)
    assert not lean.covers(several, cache, None)  # several tokens over a cache, no mask
    model.train()
    assert not lean.covers(one, cache, None)
    model.eval()
    model.set_attn_implementation("eager")
    assert not lean.covers(one, cache, None)


def test_an_uncovered_call_still_matches_the_hf_body() -> None:
    model = make_tiny_model("qwen2")
    prompt, more = torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9]])
    results = []
    with torch.inference_mode():
        for lean in (True, False):
            target = TargetForward(model, lean=lean)
            cache = target.new_cache()
            target.features(prompt, torch.arange(3)[None], cache)
            results.append(target.features(more, torch.tensor([[3, 4]]), cache))  # HF body
    assert torch.equal(results[0], results[1])


def test_cost_curve_cache_key_tells_lean_from_hf_body() -> None:
    model = make_tiny_model("llama")
    lean = _machine_key(TargetForward(model), (1, 2))
    assert lean != _machine_key(TargetForward(model, lean=False), (1, 2))
