"""EAGLE-3 heads in the decoding loop: layer taps read what HF's hidden states say, greedy
speculation equals vanilla greedy (alone, batched, over every tree kind, with a draft
vocabulary), seeded sampling repeats, and drafting computes what training unrolls.

Models and vanilla references are test_generation.py's (`_model`: tiny random models redrawn at
a larger scale, `_vanilla`: our loop's greedy output with its top-2 gaps checked).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from batched_streams import run_batched
from draft_spy import drafted_tokens
from test_batched_verify import PROMPTS, _configs
from test_generation import FLAT, PROMPT, TREES, _greedy, _model, _vanilla
from tiny_models import ARCHS, VOCAB_SIZE, make_tiny_model
from torch import nn

from selfspec.drafting.eagle3 import Eagle3Drafter
from selfspec.drafting.taps import LayerTapError, LayerTaps
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import Eagle3Head, build_heads, heads_config_for
from selfspec.heads.eagle3 import init_from_target, with_eagle3_draft_vocab
from selfspec.sampling import SamplingParams
from selfspec.target_forward import TargetForward
from selfspec.tree import DraftSampling, DynamicTree

EAGLE3_ARCHS = ("llama", "qwen2", "mistral", "gpt2")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _eagle3(arch: str, perturbed: bool = True, **overrides: object) -> Eagle3Head:
    """EAGLE-3 heads for `_model(arch)`: lm_head and norm from the target, then (perturbed)
    every parameter moved off its init so that each part of the head matters."""
    model = _model(arch)
    heads = build_heads(heads_config_for(model, "eagle3", **overrides))
    init_from_target(heads, model.get_output_embeddings(), _final_norm(model))
    if perturbed:
        generator = torch.Generator().manual_seed(4321)
        with torch.no_grad():
            for param in heads.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return heads.eval()


def _final_norm(model: nn.Module) -> nn.Module | None:
    body = model.get_decoder()
    return getattr(body, "norm", None) or getattr(body, "ln_f", None)


# -- layer taps ----------------------------------------------------------------------------------


@pytest.mark.parametrize("lean", [True, False], ids=["lean-body", "hf-body"])
@pytest.mark.parametrize("arch", ARCHS)
def test_taps_read_hf_hidden_states(arch: str, lean: bool) -> None:
    model = make_tiny_model(arch)
    target = TargetForward(model, lean=lean)
    layers = (0, 1, 2)  # the embeddings, the stream entering layer 1, the final norm's output
    taps = LayerTaps(target.body, layers)
    hooks_before = _hook_counts(model)
    ids = torch.tensor([[1, 5, 7, 9, 3, 44]])
    with torch.inference_mode():
        with taps.capture() as record:
            target.features(ids, torch.arange(6)[None], target.new_cache())
        assert _hook_counts(model) == hooks_before  # nothing stays on the target's modules
        hidden = model(ids, output_hidden_states=True).hidden_states  # L + 1 of [1, S, H]
    stacked = record.stacked()  # [1, S, 3H]
    assert torch.equal(stacked, torch.cat([hidden[k] for k in layers], dim=-1))


def _hook_counts(model: nn.Module) -> list[tuple[int, int]]:
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def test_taps_refuse_layers_outside_the_body_and_report_unseen_layers() -> None:
    target = TargetForward(make_tiny_model("llama"))
    with pytest.raises(LayerTapError, match=r"out of range for a body of 2 decoder layers"):
        LayerTaps(target.body, (0, 3))
    with LayerTaps(target.body, (1,)).capture() as record:
        pass  # no forward ran
    with pytest.raises(LayerTapError, match=r"never entered the tapped layer\(s\) \[1\]"):
        record.stacked()


# -- lossless greedy -----------------------------------------------------------------------------


@pytest.mark.parametrize("perturbed", [False, True], ids=["untrained", "perturbed"])
@pytest.mark.parametrize("arch", EAGLE3_ARCHS)
def test_greedy_speculation_equals_vanilla(arch: str, perturbed: bool) -> None:
    vanilla = list(_vanilla(arch))
    generator = SpeculativeGenerator(_model(arch), _eagle3(arch, perturbed))
    assert isinstance(generator.drafter, Eagle3Drafter)
    taus = []
    for name, tree in TREES.items():
        result = generator.generate(PROMPT, _greedy(tree))
        taus.append(result.stats.tau)
        assert result.token_ids == vanilla, f"{arch}/{name}"
        assert all(0 <= a <= tree.depth for a in result.stats.accepted_lengths)
    assert max(taus) > 1.0  # accepted paths were committed (tapped states indexed by them)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_speculation_with_chosen_layers_and_deep_trees(arch: str) -> None:
    heads = _eagle3(arch, target_layers=(2, 0))  # any order, the final norm's output included
    generator = SpeculativeGenerator(_model(arch), heads)
    deep = DynamicTree(top_k=4, depth=7, budget=30)  # EAGLE-3 drafts up to 7 deep
    result = generator.generate(PROMPT, _greedy(deep))
    assert result.token_ids == list(_vanilla(arch))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_adaptive_trees_stay_lossless(arch: str) -> None:
    generator = SpeculativeGenerator(_model(arch), _eagle3(arch), cost_curve=FLAT)
    result = generator.generate(PROMPT, _greedy(None))  # the default: adaptive
    assert result.token_ids == list(_vanilla(arch))
    assert max(s.tree_size for s in result.stats.steps) > 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    vanilla = sorted(set(_vanilla(arch)))
    chosen = vanilla[::2] + [t for t in range(VOCAB_SIZE) if t not in vanilla]
    model = _model(arch)
    heads = with_eagle3_draft_vocab(
        _eagle3(arch), torch.tensor(sorted(chosen[:40])), model.get_output_embeddings()
    ).eval()
    assert heads.lm_head.weight.shape == (40, 32)
    allowed = set(heads.draft_vocab.tolist())
    assert torch.equal(heads.t2d.nonzero().flatten(), heads.draft_vocab)
    generator = SpeculativeGenerator(model, heads)
    drafted = drafted_tokens(monkeypatch, generator.drafter)
    for tree in TREES.values():  # the heads' drafts alone (context drafts copy any token)
        result = generator.generate(PROMPT, _greedy(tree, context_drafts=None))
        assert result.token_ids == list(_vanilla(arch))
    assert drafted and set(drafted) <= allowed
    # Sampling with drafts drawn without replacement: the proposal is spread back over the whole
    # vocabulary, and seeded runs repeat.
    config = GenerationConfig(
        max_new_tokens=12,
        sampling=SamplingParams(temperature=0.8),
        seed=3,
        tree=TREES["dynamic"],
        draft_sampling=DraftSampling.WITHOUT_REPLACEMENT,
        stop_token_ids=(),
    )
    assert (
        generator.generate(PROMPT, config).token_ids == generator.generate(PROMPT, config).token_ids
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_verification_equals_each_request_alone(arch: str) -> None:
    generator = SpeculativeGenerator(_model(arch), _eagle3(arch))
    configs = _configs()
    alone = [generator.generate(p, c).token_ids for p, c in zip(PROMPTS, configs, strict=True)]
    streams = [generator.stream(p, c) for p, c in zip(PROMPTS, configs, strict=True)]
    run_batched(streams)
    assert [s.result.token_ids for s in streams] == alone


def test_batched_verification_mixes_eagle3_and_eagle_requests() -> None:
    """Requests whose heads read different layers (or none) share one forward."""
    model = _model("llama")
    eagle = build_heads(heads_config_for(model, "eagle")).eval()
    generators = [
        SpeculativeGenerator(model, _eagle3("llama")),
        SpeculativeGenerator(model, eagle),
        SpeculativeGenerator(model, _eagle3("llama", target_layers=(1,))),
    ]
    configs = _configs()[:2] + [replace(_configs()[0], max_new_tokens=9)]
    alone = [
        g.generate(p, c).token_ids for g, p, c in zip(generators, PROMPTS, configs, strict=True)
    ]
    streams = [g.stream(p, c) for g, p, c in zip(generators, PROMPTS, configs, strict=True)]
    run_batched(streams)
    assert [s.result.token_ids for s in streams] == alone


def test_conclude_without_tapped_states_is_a_clear_error() -> None:
    generator = SpeculativeGenerator(_model("llama"), _eagle3("llama"))
    stream = generator.stream(PROMPT, _greedy(TREES["chain3"]))
    stream.start()
    step = stream.draft()
    with torch.inference_mode():  # a forward of the caller's own, without the taps
        features = generator.target.features(
            step.tree.tokens[None],
            step.buffers.position_ids,
            stream.state.cache,
            step.buffers.attention_mask,
        )[0]
    with pytest.raises(RuntimeError, match="ran without the taps"):
        stream.conclude(step, features)


def test_seeded_sampling_repeats() -> None:
    generator = SpeculativeGenerator(_model("qwen2"), _eagle3("qwen2"))
    config = GenerationConfig(
        max_new_tokens=16,
        sampling=SamplingParams(temperature=0.9, top_p=0.95),
        seed=11,
        tree=TREES["dynamic"],
        stop_token_ids=(),
    )
    first = generator.generate(PROMPT, config).token_ids
    assert generator.generate(PROMPT, config).token_ids == first
