"""Draft heads run on the kernels (int8 weights) when the target does: every linear layer of the
heads and the projection's draft rows, dense weights kept, gradients untouched, output unchanged."""

from __future__ import annotations

import pytest
import torch
from test_exact_speculation import PROMPT, kernel_model
from tiny_models import make_tiny_model

from selfspec.drafting.head_kernels import draft_modules
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.kernels.modules import KernelLinear
from selfspec.tree import DynamicTree


def _linears(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_heads_of_a_kernel_target_run_on_int8_kernels(kernel_path: str, kind: str) -> None:
    model = kernel_model("llama", "float32")
    heads = build_heads(heads_config_for(model, kind)).eval()
    dense = {name: p for name, p in heads.named_parameters()}
    generator = SpeculativeGenerator(model, heads)
    modules = draft_modules(generator.drafter, heads)
    linears = [m for module in modules for m in _linears(module)]
    assert linears and all(type(m) is KernelLinear for m in linears)
    # int8 weights; int8 activations too where the rows split into blocks of 32 (w8a8).
    for m in linears:
        expected = "int8_a8" if m.in_features % 32 == 0 else "int8"
        assert m._kernel_weight.format == expected
    assert any(m._kernel_weight.format == "int8_a8" for m in linears)
    # The same Parameters as before (training, draft deltas, the heads' hash read them).
    assert all(p is dense[name] for name, p in heads.named_parameters())
    assert all(p.dtype == torch.float32 for p in heads.parameters())
    vanilla = generator.generate(
        PROMPT, GenerationConfig(max_new_tokens=24, speculate=False, stop_token_ids=())
    ).token_ids
    tree = DynamicTree(top_k=3, depth=3, budget=8)
    speculative = generator.generate(
        PROMPT, GenerationConfig(max_new_tokens=24, tree=tree, stop_token_ids=())
    )
    assert speculative.token_ids == vanilla


def test_heads_stay_torch_when_the_target_does() -> None:
    model = make_tiny_model("llama", seed=0)
    heads = build_heads(heads_config_for(model, "eagle")).eval()
    generator = SpeculativeGenerator(model, heads)
    linears = [m for module in draft_modules(generator.drafter, heads) for m in _linears(module)]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)


def test_heads_on_kernels_still_train(kernel_path: str) -> None:
    """With gradients on, a KernelLinear is F.linear over its dense weight: the heads' gradients
    are those of the plain module."""
    model = kernel_model("llama", "float32")
    heads = build_heads(heads_config_for(model, "medusa"))
    plain = build_heads(heads_config_for(model, "medusa"))
    plain.load_state_dict(heads.state_dict())
    SpeculativeGenerator(model, heads)
    features = torch.randn(3, model.config.hidden_size)
    heads(features).square().sum().backward()
    plain(features).square().sum().backward()
    for (name, got), want in zip(heads.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
