"""The C++ RMS norm and rotary embedding the lean body uses with the kernels: row-invariant, the
same bits on both instruction-set paths, the norm within float noise of transformers' and the
rotary bit-identical to the torch ops it replaces."""

from __future__ import annotations

import pytest
import torch
from conftest import cpp_paths
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from selfspec.kernels import extension, ops
from selfspec.lean_body import _rotate, sign_folded

pytestmark = pytest.mark.skipif(not cpp_paths(), reason="the C++ kernels are not built here")


def _norm(hidden: int, seed: int) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm


@pytest.mark.parametrize("hidden", [576, 64, 37, 8])  # tails below and above 16 lanes
@pytest.mark.parametrize("isa", cpp_paths())
def test_rms_norm_rows_are_invariant_and_match_transformers(
    hidden: int, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(extension.ISA_ENV, isa)
    norm = _norm(hidden, 0)
    x = torch.randn(3, 5, hidden, generator=torch.Generator().manual_seed(1)) * 3
    out = ops.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    for i in range(3):
        for j in range(5):
            alone = ops.rms_norm(x[i, j].clone(), norm.weight.detach(), norm.variance_epsilon)
            assert torch.equal(out[i, j], alone)
    with torch.no_grad():
        torch.testing.assert_close(out, norm(x), rtol=2e-6, atol=2e-6)


def test_rms_norm_gives_the_same_bits_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    if len(cpp_paths()) < 2:
        pytest.skip("only one instruction-set path runs here")
    norm = _norm(576, 2)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(3))
    results = []
    for isa in ("avx512", "avx2"):
        monkeypatch.setenv(extension.ISA_ENV, isa)
        results.append(ops.rms_norm(x, norm.weight.detach(), norm.variance_epsilon))
    assert torch.equal(*results)


def test_rotary_is_bit_identical_to_the_torch_ops() -> None:
    generator = torch.Generator().manual_seed(4)
    states = torch.randn(2, 3, 9, 64, generator=generator)
    angles = torch.randn(2, 3, 64, generator=generator)
    cos, signed_sin = angles.cos(), sign_folded(angles.sin())
    expected = _rotate(states, cos.unsqueeze(2), signed_sin.unsqueeze(2))
    out = ops.rotary_(states.clone(), cos, signed_sin)
    assert torch.equal(out, expected)


def test_the_glue_ops_check_their_arguments() -> None:
    with pytest.raises(RuntimeError, match=r"norm weight must be float32 \[8\]"):
        ops.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5)
    with pytest.raises(RuntimeError, match="even head size"):
        ops.rotary_(torch.zeros(1, 1, 2, 5), torch.zeros(1, 1, 5), torch.zeros(1, 1, 5))
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rotary_(torch.zeros(1, 2, 2, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_lean_body_fuses_its_norms_only_where_they_are_plain(arch: str) -> None:
    from tiny_models import make_tiny_model

    from selfspec.kernels.modules import install_kernels
    from selfspec.lean_body import LeanBody

    model = make_tiny_model(arch).eval()
    assert not LeanBody(model.model).fused_glue  # transformers' linear layers: SDPA, its norms
    install_kernels(model, "float32")
    assert LeanBody(model.model).fused_glue
    seen = []
    norm = model.model.layers[0].input_layernorm
    handle = norm.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    LeanBody(model.model)(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), DynamicCache())
    handle.remove()
    assert len(seen) == 1  # a hooked norm is called as a module (EAGLE-3's layer taps)
