"""The engine on a GPU: the target, heads and every step's tensors on cuda, lossless as on a CPU.

Skipped without a CUDA GPU (``scripts/gpu_check.sh`` runs them on a GPU machine). Models are the
tiny ones of tiny_models.py redrawn at a larger scale (as in test_generation.py: top-2 logit gaps
above 1e-3 along the output), in float32 with TF32 off (torch's default for matmuls), so
speculative and vanilla greedy agree token for token even though a GPU matmul over a tree of
rows need not round a row as it does over one.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from batched_streams import run_batched
from tiny_models import make_lively_model, make_tiny_model, redraw_lively, save_tiny_target

from selfspec.cost_curve import measure_cost_curve
from selfspec.fingerprint import fingerprint_of
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for, load_heads, save_heads
from selfspec.heads.draft_vocab import with_draft_vocab
from selfspec.kernels.modules import uses_kernels
from selfspec.sampling import SamplingParams
from selfspec.target import TargetSpec, load_target
from selfspec.target_forward import TargetForward
from selfspec.tree import DraftSampling, DynamicTree, StaticTree

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda", 0)
PROMPT = [1, 23, 5, 61, 8, 30]
NEW_TOKENS = 24
TREES = {
    "dynamic": DynamicTree(top_k=3, depth=4, budget=12),
    "chain3": StaticTree.chain(3),
    "full": StaticTree.full((2, 2, 1)),
}
SAMPLED = SamplingParams(temperature=0.8, top_k=40)


@functools.cache
def _model(arch: str, device: str) -> torch.nn.Module:
    """test_generation.py's models (whose top-2 gaps it checks along this prompt's output)."""
    return make_lively_model(arch).to(device)


def _heads(arch: str, kind: str) -> torch.nn.Module:
    model = _model(arch, "cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        heads = build_heads(heads_config_for(model, kind))
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in heads.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return heads.eval().to(CUDA)


def _config(**kwargs: object) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW_TOKENS, stop_token_ids=(), **kwargs)


@functools.cache
def _vanilla(arch: str, device: str) -> tuple[int, ...]:
    result = SpeculativeGenerator(_model(arch, device)).generate(PROMPT, _config(speculate=False))
    return tuple(result.token_ids)


# -- the target and its heads on the GPU ---------------------------------------------------------


@pytest.mark.parametrize("device", ["cuda", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_target_loads_onto_the_gpu_with_transformers_ops(
    tmp_path: Path, dtype: str, device: str
) -> None:
    directory = save_tiny_target(tmp_path / "tiny-llama")
    target = load_target(TargetSpec(model=str(directory), dtype=dtype, device=device))
    assert target.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in target.model.parameters())
    assert not uses_kernels(target.model)  # the kernels are CPU code
    reference = make_tiny_model("llama")
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.inference_mode():
        logits = target.model(ids.to(CUDA)).logits.float().cpu()
        expected = reference(ids).logits
    tolerance = 1e-4 if dtype == "float32" else 0.05
    torch.testing.assert_close(logits, expected, atol=tolerance, rtol=tolerance)


def test_heads_load_onto_the_targets_gpu(tmp_path: Path) -> None:
    directory = save_tiny_target(tmp_path / "tiny-llama")
    target = load_target(TargetSpec(model=str(directory), device="cuda", dtype="bfloat16"))
    heads = build_heads(heads_config_for(target.model, "eagle"))
    save_heads(heads, tmp_path / "heads", fingerprint_of(target.model))
    loaded = load_heads(tmp_path / "heads", target.model)
    tensors = [*loaded.parameters(), *loaded.buffers()]
    assert all(t.device == target.device for t in tensors)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    narrowed = with_draft_vocab(loaded, torch.arange(2, 60))
    assert all(t.device == target.device for t in [*narrowed.parameters(), *narrowed.buffers()])
    generator = SpeculativeGenerator(target.model, narrowed, target.tokenizer)
    result = generator.generate(PROMPT, _config(tree=TREES["dynamic"]))
    assert len(result.token_ids) == NEW_TOKENS


# -- greedy: lossless ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_vanilla_on_the_gpu_matches_hf_generate_and_the_cpu(arch: str) -> None:
    model = _model(arch, "cuda")
    prompt = torch.tensor([PROMPT], device=CUDA)
    with torch.inference_mode():
        hf = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
        )[0, len(PROMPT) :].tolist()
    ours = SpeculativeGenerator(model).generate(
        PROMPT, GenerationConfig(max_new_tokens=NEW_TOKENS, speculate=False)
    )  # the model's EOS stops both
    assert ours.token_ids == hf
    assert _vanilla(arch, "cuda") == _vanilla(arch, "cpu")


@pytest.mark.parametrize("kind", ["eagle", "medusa", "eagle3"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_speculation_on_the_gpu_equals_vanilla(arch: str, kind: str) -> None:
    generator = SpeculativeGenerator(_model(arch, "cuda"), _heads(arch, kind))
    taus = []
    for name, tree in TREES.items():
        if kind == "medusa" and tree.depth > generator.heads.config.num_heads:
            continue
        result = generator.generate(PROMPT, _config(tree=tree))
        assert tuple(result.token_ids) == _vanilla(arch, "cuda"), f"{arch}/{kind}/{name}"
        taus.append(result.stats.tau)
    assert max(taus) > 1.0, "no draft was ever accepted: commits were not exercised"


def test_batched_verification_on_the_gpu_equals_each_request_alone() -> None:
    generator = SpeculativeGenerator(_model("llama", "cuda"), _heads("llama", "eagle"))
    configs = [
        _config(tree=TREES["dynamic"]),
        _config(tree=TREES["chain3"]),
        _config(speculate=False),
        _config(tree=TREES["dynamic"], sampling=SAMPLED, seed=5),
    ]
    prompts = [PROMPT, PROMPT[:3], [1, 90, 4], PROMPT]
    alone = [generator.generate(p, c).token_ids for p, c in zip(prompts, configs, strict=True)]
    streams = [generator.stream(p, c) for p, c in zip(prompts, configs, strict=True)]
    run_batched(streams)
    # Greedy rows: lossless; the sampled row: its own generator, the same draws as alone.
    assert [s.result.token_ids for s in streams] == alone


# -- sampling: on-device generators, seeded, the target's distribution ---------------------------


@pytest.mark.parametrize("draft_sampling", list(DraftSampling))
def test_sampling_on_the_gpu_draws_from_a_gpu_generator_and_repeats_by_seed(
    draft_sampling: DraftSampling,
) -> None:
    generator = SpeculativeGenerator(_model("llama", "cuda"), _heads("llama", "eagle"))
    config = _config(
        tree=TREES["dynamic"], sampling=SAMPLED, seed=11, draft_sampling=draft_sampling
    )
    stream = generator.stream(PROMPT, config)
    stream.start()
    assert stream.state.generator.device.type == "cuda"
    while not stream.done:
        stream.step()
    again = generator.generate(PROMPT, config).token_ids
    other = generator.generate(PROMPT, _config(tree=TREES["dynamic"], sampling=SAMPLED, seed=12))
    assert stream.result.token_ids == again
    assert other.token_ids != again  # the seed decides (24 tokens at temperature 0.8)


def test_speculative_sampling_on_the_gpu_has_the_targets_distribution() -> None:
    """test_sampling_end_to_end's check (sequence distribution vs the exact one, within the
    bound that sampling noise reaches), on the GPU."""
    import test_sampling_end_to_end as end_to_end

    model = end_to_end._peaky_tiny_llama()
    exact = end_to_end._exact_distribution(model)
    bound = end_to_end._null_tv_bound(exact)
    heads = end_to_end._perturbed_heads(model, "eagle").to(CUDA)
    generator = SpeculativeGenerator(model.to(CUDA), heads)
    tree, draft_sampling = StaticTree.full((3, 1)), DraftSampling.WITHOUT_REPLACEMENT
    empirical = end_to_end._empirical(generator, tree, draft_sampling)
    tv = 0.5 * float((empirical - exact).abs().sum())
    assert tv <= 1.15 * bound, f"TV {tv:.4f} above the sampling-noise bound {bound:.4f}"


# -- adapters and timing -------------------------------------------------------------------------


def test_the_lora_bank_on_the_gpu_applies_each_rows_adapter() -> None:
    pytest.importorskip("peft")
    from selfspec.adapters import fast_lora

    model = redraw_lively(make_tiny_model("llama"), seed=0).to(CUDA)
    bank = fast_lora.LoraBank(model)
    hidden = model.config.hidden_size
    cpu = torch.Generator().manual_seed(5)
    name = "model.layers.0.self_attn.q_proj"
    lora_a, lora_b = torch.randn(4, hidden, generator=cpu), torch.randn(hidden, 4, generator=cpu)
    bank.add("a", {name: fast_lora.LoraWeights(lora_a, lora_b, 0.5)})  # read on the CPU
    module = model.get_submodule(name)
    x = torch.randn(2, 3, hidden, device=CUDA)
    with torch.inference_mode():
        base = module(x)
        expected = base + 0.5 * (x @ lora_a.to(CUDA).T) @ lora_b.to(CUDA).T
        bank.select("a")
        torch.testing.assert_close(module(x), expected)
        bank.select_rows(["a", None])
        mixed = module(x)
    torch.testing.assert_close(mixed[0], expected[0])
    torch.testing.assert_close(mixed[1], base[1])
    bank.close()


def test_the_cost_curve_times_gpu_forwards() -> None:
    curve = measure_cost_curve(
        TargetForward(_model("llama", "cuda")), sizes=(1, 4, 16), context=32, repeats=2
    )
    assert curve.sizes == (1, 4, 16) and all(s > 0 for s in curve.seconds)
