"""An EAGLE head's layers as one C++ call (``selfspec.drafting.fused_head``): the head's function
up to rounding, written into the same cache; the torch path wherever something is in its way."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import cpp_paths
from tiny_models import make_tiny_model

from selfspec.drafting.fused_head import FusedEagle3Head, FusedEagleHead
from selfspec.heads import build_heads, heads_config_for
from selfspec.heads.delta import Delta, DeltaBank, DeltaConfig, delta_modules
from selfspec.heads.eagle import EagleCache
from selfspec.kernels.modules import install_kernels

pytestmark = pytest.mark.skipif(not cpp_paths(), reason="the C++ kernels are not built here")


def random_head(model, kind: str = "eagle", layers: int = 1):
    """Heads of ``kind`` for ``model`` with random weights (seeded), not the identity an
    untrained head starts as."""
    config = heads_config_for(model, kind)
    if kind == "eagle":
        config = replace(config, num_layers=layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = build_heads(config).eval()
        with torch.no_grad():
            for parameter in head.parameters():
                parameter.normal_(0.0, 0.3 if parameter.dim() > 1 else 1.0)
    return head


def _head(
    layers: int = 1,
    kernels: bool = True,
    kind: str = "eagle",
    mode: str = "w8a8",
    dtype: torch.dtype | None = None,
):
    """``mode``: the heads' kernel mode (``head_kernels``: w8a8, whose weights are interleaved by
    16 columns, so the fused plan's q/k/v and gate/up splits fall on groups; int8 before).
    ``dtype``: the head cast to it first (a bf16 target's heads)."""
    head = random_head(make_tiny_model("llama"), kind, layers)
    if dtype is not None:
        head = head.to(dtype)
    if kernels:
        install_kernels(head, mode)
    return head


def _steps(
    forward, head, cache: EagleCache, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """A 6-token prefix (causal), then a 3-node tree step over it with a mask."""
    hidden = head.config.hidden_size
    generator = torch.Generator().manual_seed(1)
    embeds, features = (torch.randn(1, 9, hidden, generator=generator).to(dtype) for _ in range(2))
    first = forward(embeds[:, :6], features[:, :6], torch.arange(1, 7)[None], None, cache)
    attend = torch.ones(1, 1, 3, 9, dtype=torch.bool)
    attend[0, 0, 1, 8] = attend[0, 0, 2, 7] = False  # nodes 1 and 2: siblings
    second = forward(embeds[:, 6:], features[:, 6:], torch.tensor([[7, 8, 8]]), attend, cache)
    return [first, second, *cache.keys, *cache.values]


@pytest.mark.parametrize("mode", ["w8a8", "int8", "bf16 head, w8a8"])
@pytest.mark.parametrize(("kind", "layers"), [("eagle", 1), ("eagle", 2), ("eagle3", 1)])
def test_fused_head_computes_the_head_up_to_rounding(kind: str, layers: int, mode: str) -> None:
    """fp32 heads agree to 1e-4; a bf16 head (a bf16 target's) to bf16's rounding."""
    dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float32
    bf16 = dtype == torch.bfloat16
    head = _head(layers, kind=kind, mode=mode.split(", ")[-1], dtype=dtype)
    fused = (FusedEagleHead if kind == "eagle" else FusedEagle3Head)(head)
    with torch.inference_mode():
        expected = _steps(head, head, EagleCache(), dtype)
        cache = EagleCache()
        got = _steps(fused, head, cache, dtype)
        assert fused._current_plan(got[0]) is not None  # it ran fused
    assert cache.lengths == [9] * layers
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        tolerance = 0.08 * float(b.abs().max()) if bf16 else 1e-4  # measured: <= 0.04
        torch.testing.assert_close(
            a.float(), b.float(), rtol=1e-4 if not bf16 else 0.0, atol=tolerance
        )


def test_the_torch_path_runs_where_the_fused_one_cannot() -> None:
    """Autograd, a hook, an active draft delta, heads off the kernels: the head's own forward,
    bit for bit; a changed weight: a new plan."""
    head = _head()
    fused = FusedEagleHead(head)
    with torch.inference_mode():
        expected = _steps(head, head, EagleCache())

    def same_as_head() -> None:
        with torch.inference_mode():
            for a, b in zip(_steps(fused, head, EagleCache()), expected, strict=True):
                assert torch.equal(a, b)

    handle = head.layers[0].gate_up.register_forward_hook(lambda _m, _a, out: None)
    try:
        same_as_head()
    finally:
        handle.remove()
    names = delta_modules(head)
    bank = DeltaBank(head)
    rank = 2
    state = {}
    for name in names:
        layer = head.get_submodule(name).base
        state[f"{name}.lora_A"] = torch.full((rank, layer.in_features), 0.01)
        state[f"{name}.lora_B"] = torch.full((layer.out_features, rank), 0.01)
    bank.add("a", Delta(DeltaConfig(rank=rank, alpha=rank), bank.hash, state))
    with torch.inference_mode(), bank.active("a"):
        delta_expected = _steps(head, head, EagleCache())
        got = _steps(fused, head, EagleCache())
    for a, b in zip(got, delta_expected, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(delta_expected[0], expected[0])
    with torch.inference_mode():  # no delta active: the banked layers run fused again
        assert fused._current_plan(expected[0]) is not None
    with torch.inference_mode():
        assert FusedEagleHead(_head(kernels=False))._current_plan(expected[0]) is None
    assert fused._current_plan(expected[0].clone().requires_grad_(False)) is None  # autograd on
    with torch.inference_mode():
        plan = fused._current_plan(expected[0])
        with torch.no_grad():
            head.layers[0].down.weight.mul_(2.0)
        assert fused._current_plan(expected[0]) is not plan
