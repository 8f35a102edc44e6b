"""Row invariance through the whole model: with the kernels installed, a tree forward computes
every token exactly as plain decoding of its path does, and speculative greedy output equals
vanilla greedy output token for token, in every mode (float32, bfloat16, int8, int4, w4a8, and
float32 from quantized blocks with 24-bit integer activations), on the C++ kernels and on the
pure-torch fallback."""

from __future__ import annotations

import pytest
import torch
from tiny_models import install_block_kernels, make_tiny_model

from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.kernels.modules import KernelLinear, install_kernels, uses_kernels
from selfspec.target_forward import TargetForward
from selfspec.tree import DynamicTree, StaticTree

# "float32:int24": float32 from Q4_1 / int8 blocks with 24-bit integer activations
MODES = ("float32", "bfloat16", "int8", "int4", "w4a8", "float32:int24")
PROMPT = [1, 23, 5, 61, 8, 30, 44, 12]
# A tree of 9 nodes: parents first. Paths 0-1-3-6, 0-1-4, 0-2-5-7-8.
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5, 7]
TOKENS = [17, 40, 3, 99, 12, 56, 7, 71, 28]


def kernel_model(arch: str, mode: str) -> torch.nn.Module:
    model = make_tiny_model(arch, seed=3)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # livelier than the default init, so outputs are not degenerate
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    if mode == "bfloat16":
        model = model.to(torch.bfloat16)
    if mode == "float32:int24":
        install_block_kernels(model, "int24")
    else:
        install_kernels(model, mode, output_layer=model.get_output_embeddings())
    return model


def depths_of(parents: list[int]) -> list[int]:
    depths = [0] * len(parents)
    for i, parent in enumerate(parents[1:], start=1):
        depths[i] = depths[parent] + 1
    return depths


def ancestors(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tree_forward_equals_decoding_each_path(kernel_path: str, arch: str, mode: str) -> None:
    model = kernel_model(arch, mode)
    target = TargetForward(model)
    assert target.lean is not None and target.lean.fixed_order and uses_kernels(model)
    prompt = torch.tensor([PROMPT])
    length = len(PROMPT)
    with torch.no_grad():
        cache = target.new_cache()
        target.features(prompt, torch.arange(length)[None], cache)
        depths = depths_of(PARENTS)
        size = len(PARENTS)
        allowed = torch.zeros(size, length + size, dtype=torch.bool)
        allowed[:, :length] = True
        for node in range(size):
            allowed[node, [length + a for a in ancestors(PARENTS, node)]] = True
        mask = torch.where(allowed, 0.0, torch.finfo(target.dtype).min).to(target.dtype)
        tree_logits = target.logits(
            target.features(
                torch.tensor([TOKENS]),
                torch.tensor([[length + d for d in depths]]),
                cache,
                mask[None, None],
            )
        )[0]  # [tree, vocab]
        for leaf in (6, 4, 8):
            path = ancestors(PARENTS, leaf)
            cache = target.new_cache()
            target.features(prompt, torch.arange(length)[None], cache)
            for depth, node in enumerate(path):
                features = target.features(
                    torch.tensor([[TOKENS[node]]]), torch.tensor([[length + depth]]), cache
                )
                alone = target.logits(features)[0, 0]
                assert torch.equal(alone, tree_logits[node]), f"{arch} {mode}: node {node}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_speculation_equals_vanilla_in_every_mode(
    kernel_path: str, arch: str, mode: str
) -> None:
    model = kernel_model(arch, mode)
    heads = build_heads(heads_config_for(model, "eagle")).eval()
    if mode == "bfloat16":
        heads = heads.to(torch.bfloat16)
    generator = SpeculativeGenerator(model, heads)
    config = GenerationConfig(max_new_tokens=30, speculate=False, stop_token_ids=())
    vanilla = generator.generate(PROMPT, config).token_ids
    assert len(set(vanilla)) > 4, "degenerate vanilla output"
    for tree in (StaticTree.full((3, 2, 2)), DynamicTree(top_k=4, depth=4, budget=10)):
        result = generator.generate(
            PROMPT, GenerationConfig(max_new_tokens=30, tree=tree, stop_token_ids=())
        )
        assert result.token_ids == vanilla, f"{arch} {mode} {tree}"


def test_int4_and_int8_modes_quantize_and_keep_the_dense_weight() -> None:
    model = kernel_model("llama", "int4")
    layers = [m for m in model.modules() if type(m) is KernelLinear]
    formats = {m._kernel_weight.format for m in layers}
    assert formats == {"q4_1", "int8"}  # the output layer in 8 bits
    assert model.get_output_embeddings()._kernel_weight.format == "int8"
    assert model.get_output_embeddings()._kernel_weight.group == 32
    assert all(m.weight.dtype == torch.float32 for m in layers)  # dense kept for peft/training
    int8 = kernel_model("llama", "int8")
    assert {m._kernel_weight.format for m in int8.modules() if type(m) is KernelLinear} == {"int8"}
