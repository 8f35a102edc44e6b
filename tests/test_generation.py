"""The decoding loop: lossless greedy speculation, oracle drafts, determinism, stops, bad input.

Models: the tiny random models of tiny_models.py with their weights redrawn at a larger scale
(`make_lively_model`). At the default init (std 0.02) the tied-embedding tiny models (llama,
gpt2) just repeat the last prompt token and the others have top-2 logit gaps of ~1e-4, so
"speculative == vanilla" would be checked on trivial sequences or within float noise. Redrawn,
every architecture produces varied text with top-2 gaps > 1e-3, which `_vanilla` asserts along
the whole output.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace

import pytest
import torch
from draft_spy import drafted_tokens
from oracle_drafter import OracleDrafter
from tiny_models import ARCHS, VOCAB_SIZE, make_lively_model
from transformers import DynamicCache, PreTrainedModel

import selfspec.generation as generation_module
from selfspec.cost_curve import CostCurve
from selfspec.generation import FinishReason, GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.heads.draft_vocab import set_draft_vocab
from selfspec.sampling import SamplingParams
from selfspec.tree import DEFAULT_STATIC_TREE, DraftSampling, DynamicTree, StaticTree, TreeSpec

PROMPT = [1, 23, 5, 61, 8, 30]
NEW_TOKENS = 24
NO_STOP: tuple[int, ...] = ()
TREES = {
    "dynamic": DynamicTree(top_k=3, depth=4, budget=12),
    "default_static": DEFAULT_STATIC_TREE,
    "chain3": StaticTree.chain(3),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run ~10x faster on one thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _model(arch: str) -> PreTrainedModel:
    return make_lively_model(arch)


@functools.cache
def _vanilla(arch: str, new_tokens: int = NEW_TOKENS) -> tuple[int, ...]:
    """Vanilla greedy tokens through our loop; checks the top-2 gap along the way."""
    model = _model(arch)
    result = SpeculativeGenerator(model).generate(
        PROMPT,
        GenerationConfig(max_new_tokens=new_tokens, speculate=False, stop_token_ids=NO_STOP),
    )
    tokens = result.token_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, "top-2 logits within float noise: pick a prompt"
    assert len(set(tokens)) > 4, "degenerate vanilla output: pick a prompt"
    return tuple(tokens)


def _heads(arch: str, kind: str, perturbed: bool) -> torch.nn.Module:
    model = _model(arch)
    heads = build_heads(heads_config_for(model, kind))
    if perturbed:
        generator = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for param in heads.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return heads.eval()


def _greedy(
    tree: TreeSpec | None, new_tokens: int = NEW_TOKENS, **kwargs: object
) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, tree=tree, stop_token_ids=NO_STOP, **kwargs)


# -- lossless greedy -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_vanilla_loop_matches_hf_generate(arch: str) -> None:
    model = _model(arch)
    prompt = torch.tensor([PROMPT])
    hf = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
    )[0, len(PROMPT) :].tolist()
    ours = SpeculativeGenerator(model).generate(
        PROMPT, GenerationConfig(max_new_tokens=NEW_TOKENS, speculate=False)
    )  # default stop ids: the model's EOS, as HF uses
    assert ours.token_ids == hf
    assert list(_vanilla(arch)[: len(hf)]) == hf


@pytest.mark.parametrize("perturbed", [False, True], ids=["untrained", "perturbed"])
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculation_equals_vanilla(arch: str, kind: str, perturbed: bool) -> None:
    vanilla = list(_vanilla(arch))
    generator = SpeculativeGenerator(_model(arch), _heads(arch, kind, perturbed))
    taus = []
    for name, tree in TREES.items():
        result = generator.generate(PROMPT, _greedy(tree))
        taus.append(result.stats.tau)
        assert result.token_ids == vanilla, f"{arch}/{kind}/{name}"
        assert result.finish_reason is FinishReason.LENGTH
        # Every committed token came from a step: the first from prefill, then accepted + bonus.
        per_step = [a + 1 for a in result.stats.accepted_lengths]
        assert 1 + sum(per_step[:-1]) < NEW_TOKENS <= 1 + sum(per_step)
        assert all(0 <= a <= tree.depth for a in result.stats.accepted_lengths)
    # Some drafts were accepted, so committing accepted paths was exercised, not only rejections.
    assert max(taus) > 1.0


# -- oracle drafts -------------------------------------------------------------------------------


def _spy_commits(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    seen: list[list[int]] = []
    real = generation_module.commit_accepted

    def spy(cache: DynamicCache, committed_len: int, accepted: torch.Tensor) -> None:
        seen.append(accepted.tolist())
        return real(cache, committed_len, accepted)

    monkeypatch.setattr(generation_module, "commit_accepted", spy)
    return seen


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_chain_accepts_full_depth(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    depth = 4
    known = list(_vanilla(arch, NEW_TOKENS + depth + 1))  # the oracle sees past the end
    generator = SpeculativeGenerator(_model(arch))
    generator.drafter = OracleDrafter(known, VOCAB_SIZE)
    commits = _spy_commits(monkeypatch)
    result = generator.generate(PROMPT, _greedy(StaticTree.chain(depth), context_drafts=None))
    assert result.token_ids == known[:NEW_TOKENS]
    assert result.stats.accepted_lengths == [depth] * len(result.stats.steps)
    assert result.stats.tau == depth + 1
    assert result.stats.acceptance_by_depth() == [1.0] * depth
    assert commits == [list(range(depth + 1))] * len(result.stats.steps)


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_tree_with_correct_token_at_rank_one(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wrong tokens sit at rank 0 at depths 1 and 3: the accepted path is nodes 0, 2, 5, 12 of
    the full (2, 2, 2) tree, so the KV commit must gather non-contiguous entries every step."""
    tree = StaticTree.full((2, 2, 2))
    known = list(_vanilla(arch, NEW_TOKENS + tree.depth + 1))
    generator = SpeculativeGenerator(_model(arch))
    oracle = OracleDrafter(known, VOCAB_SIZE, correct_rank=(1, 0, 1))
    generator.drafter = oracle
    commits = _spy_commits(monkeypatch)
    result = generator.generate(PROMPT, _greedy(tree, context_drafts=None))
    assert result.token_ids == known[:NEW_TOKENS]
    assert commits == [[0, 2, 5, 12]] * len(result.stats.steps)
    assert result.stats.tau == tree.depth + 1
    assert all(drafted.size == 15 for drafted in oracle.drafted_trees)


def test_oracle_with_partial_knowledge_still_matches_vanilla(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The oracle knows only the first 10 tokens; past them it drafts junk, which is rejected."""
    known = list(_vanilla("qwen2"))
    generator = SpeculativeGenerator(_model("qwen2"))
    generator.drafter = OracleDrafter(known[:10], VOCAB_SIZE, correct_rank=(1, 0))
    _spy_commits(monkeypatch)
    result = generator.generate(PROMPT, _greedy(StaticTree.full((3, 2))))
    assert result.token_ids == known
    assert result.stats.accepted_lengths[0] == 2
    assert result.stats.accepted_lengths[-1] == 0
    assert 1.0 < result.stats.tau < 3.0


# -- sampling determinism ------------------------------------------------------------------------


@pytest.mark.parametrize("draft_sampling", list(DraftSampling))
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_seeded_sampling_repeats(kind: str, draft_sampling: DraftSampling) -> None:
    generator = SpeculativeGenerator(_model("llama"), _heads("llama", kind, perturbed=True))

    def run(seed: int) -> list[int]:
        config = GenerationConfig(
            max_new_tokens=16,
            sampling=SamplingParams(temperature=1.0, top_p=0.95),
            seed=seed,
            tree=DynamicTree(top_k=3, depth=3, budget=8),
            draft_sampling=draft_sampling,
            stop_token_ids=NO_STOP,
        )
        return generator.generate(PROMPT, config).token_ids

    first = run(7)
    assert run(7) == first
    # 16 tokens at temperature 1 over 101 tokens: equal by chance with negligible probability.
    assert run(8) != first


def test_seeded_vanilla_sampling_repeats() -> None:
    generator = SpeculativeGenerator(_model("mistral"))

    def run(seed: int) -> list[int]:
        config = GenerationConfig(
            max_new_tokens=16,
            sampling=SamplingParams(temperature=1.0),
            seed=seed,
            speculate=False,
            stop_token_ids=NO_STOP,
        )
        return generator.generate(PROMPT, config).token_ids

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_unseeded_generation_leaves_the_global_rng_alone() -> None:
    """DESIGN.md: randomness goes through a per-request generator; nothing global."""
    generator = SpeculativeGenerator(_model("llama"))
    config = GenerationConfig(max_new_tokens=3, speculate=False, stop_token_ids=NO_STOP)
    torch.manual_seed(99)
    expected = torch.rand(4)
    torch.manual_seed(99)
    generator.generate(PROMPT, config)  # seed=None
    assert torch.equal(torch.rand(4), expected)


# -- stop conditions and stats -------------------------------------------------------------------


@pytest.mark.parametrize("new_tokens", [1, 2, 7])
def test_max_new_tokens_is_exact_mid_step(new_tokens: int) -> None:
    known = list(_vanilla("gpt2"))
    generator = SpeculativeGenerator(_model("gpt2"))
    generator.drafter = OracleDrafter(known, VOCAB_SIZE)  # commits 5 tokens per step
    result = generator.generate(PROMPT, _greedy(StaticTree.chain(4), new_tokens=new_tokens))
    assert result.token_ids == known[:new_tokens]
    assert result.finish_reason is FinishReason.LENGTH
    assert result.stats.new_tokens == new_tokens


def test_stop_token_ends_generation_mid_step() -> None:
    known = list(_vanilla("gpt2"))
    stop_at = next(i for i in range(2, len(known)) if known[i] not in known[:i])
    generator = SpeculativeGenerator(_model("gpt2"))
    generator.drafter = OracleDrafter(known, VOCAB_SIZE)
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, tree=StaticTree.chain(4), stop_token_ids=(known[stop_at],)
    )
    chunks = []
    stream = generator.stream(PROMPT, config)
    for output in stream:
        chunks.extend(output.token_ids)
    result = stream.result
    assert result.token_ids == known[: stop_at + 1] == chunks
    assert result.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_stop_token_with_heads_matches_vanilla(kind: str) -> None:
    known = list(_vanilla("qwen2"))
    stop_at = next(i for i in range(3, len(known)) if known[i] not in known[:i])
    generator = SpeculativeGenerator(_model("qwen2"), _heads("qwen2", kind, perturbed=True))
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, tree=DEFAULT_STATIC_TREE, stop_token_ids=(known[stop_at],)
    )
    result = generator.generate(PROMPT, config)
    assert result.token_ids == known[: stop_at + 1]
    assert result.finish_reason is FinishReason.STOP


def test_vanilla_stats() -> None:
    result = SpeculativeGenerator(_model("llama")).generate(
        PROMPT, GenerationConfig(max_new_tokens=10, speculate=False, stop_token_ids=NO_STOP)
    )
    stats = result.stats
    assert stats.tau == 1.0
    assert stats.target_forwards == 9  # the first token comes from prefill
    assert stats.acceptance_by_depth() == []
    assert stats.prompt_tokens == len(PROMPT) and stats.new_tokens == 10
    assert result.to_dict()["stats"]["tau"] == 1.0


@pytest.mark.parametrize("tree_name", list(TREES))
def test_speculative_stats_shape(tree_name: str) -> None:
    tree = TREES[tree_name]
    generator = SpeculativeGenerator(_model("qwen2"), _heads("qwen2", "eagle", perturbed=True))
    stats = generator.generate(PROMPT, _greedy(tree)).stats
    rates = stats.acceptance_by_depth()
    assert len(rates) == max(s.tree_depth for s in stats.steps)
    assert len(rates) <= tree.depth
    if isinstance(tree, StaticTree):
        assert len(rates) == tree.depth
        # Static trees reach every depth every step, so acceptance can only fall with depth.
        assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert all(0.0 <= r <= 1.0 for r in rates)
    assert stats.tau == pytest.approx(1 + sum(stats.accepted_lengths) / len(stats.steps))
    assert stats.to_dict()["target_forwards"] == len(stats.steps)


# -- bad input -----------------------------------------------------------------------------------


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        SpeculativeGenerator(_model("llama")).generate([], GenerationConfig(speculate=False))


@pytest.mark.parametrize("bad", [VOCAB_SIZE, -1, 10_000])
def test_out_of_range_token_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"out of range.*{VOCAB_SIZE}"):
        SpeculativeGenerator(_model("llama")).generate(
            [5, bad, 7], GenerationConfig(speculate=False)
        )


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_context_limit(arch: str) -> None:
    """512 positions: prompt + max_new_tokens (+ tree depth when speculating) must fit."""
    model = _model(arch)
    prompt = [(7 * i) % (VOCAB_SIZE - 2) + 2 for i in range(500)]
    vanilla = SpeculativeGenerator(model)
    with pytest.raises(ValueError, match="512"):
        vanilla.generate(prompt, GenerationConfig(max_new_tokens=13, speculate=False))
    fits = vanilla.generate(
        prompt, GenerationConfig(max_new_tokens=12, speculate=False, stop_token_ids=NO_STOP)
    )
    assert len(fits.token_ids) == 12
    heads = SpeculativeGenerator(model, _heads(arch, "medusa", perturbed=False))
    with pytest.raises(ValueError, match="512"):
        heads.generate(prompt, _greedy(StaticTree.chain(3), new_tokens=10))
    fits = heads.generate(prompt, _greedy(StaticTree.chain(3), new_tokens=9))
    assert fits.token_ids == vanilla.generate(prompt, _greedy(None, 9, speculate=False)).token_ids


def test_speculation_without_heads_is_refused() -> None:
    with pytest.raises(ValueError, match="heads"):
        SpeculativeGenerator(_model("llama")).generate(PROMPT, GenerationConfig(speculate=True))


def test_medusa_tree_deeper_than_heads_is_refused() -> None:
    generator = SpeculativeGenerator(_model("llama"), _heads("llama", "medusa", perturbed=False))
    with pytest.raises(ValueError, match="Medusa"):
        generator.generate(PROMPT, _greedy(StaticTree.chain(5)))


def test_invalid_max_new_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)


# -- draft vocabulary and adaptive trees ---------------------------------------------------------


def _with_draft_vocab(heads: torch.nn.Module, arch: str, size: int) -> torch.nn.Module:
    """The same heads, restricted to `size` draft tokens: half of vanilla's tokens, then others."""
    config = replace(heads.config, draft_vocab_size=size)
    restricted = build_heads(config)
    restricted.load_state_dict({**heads.state_dict(), "draft_vocab": restricted.draft_vocab})
    vanilla = sorted(set(_vanilla(arch)))
    chosen = vanilla[::2] + [t for t in range(VOCAB_SIZE) if t not in vanilla]
    set_draft_vocab(restricted, torch.tensor(chosen[:size]))
    return restricted.eval()


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("arch", ARCHS)
def test_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(
    arch: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    heads = _with_draft_vocab(_heads(arch, kind, perturbed=True), arch, size=40)
    allowed = set(heads.draft_vocab.tolist())
    generator = SpeculativeGenerator(_model(arch), heads)
    drafted = drafted_tokens(monkeypatch, generator.drafter)
    for tree in TREES.values():  # the heads' drafts alone (context drafts copy any token)
        result = generator.generate(PROMPT, _greedy(tree, context_drafts=None))
        assert result.token_ids == list(_vanilla(arch))
    assert drafted and set(drafted) <= allowed
    # Sampling: the proposal is spread back over the whole vocabulary (zero outside the draft
    # vocabulary) and seeded runs repeat.
    config = GenerationConfig(
        max_new_tokens=12,
        sampling=SamplingParams(temperature=0.8),
        seed=3,
        tree=TREES["dynamic"],
        draft_sampling=DraftSampling.WITHOUT_REPLACEMENT,
        stop_token_ids=NO_STOP,
    )
    assert (
        generator.generate(PROMPT, config).token_ids == generator.generate(PROMPT, config).token_ids
    )


FLAT = CostCurve(sizes=(1, 64), seconds=(1.0, 1.0))
"""Verification costs the same at any size: every drafted node is worth verifying."""
STEEP = CostCurve(sizes=(1, 2), seconds=(1.0, 1000.0))
"""A second tree token costs 1000x: no draft is worth verifying."""


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("arch", ARCHS)
def test_adaptive_tree_sizes_follow_the_cost_curve_and_stay_lossless(arch: str, kind: str) -> None:
    heads = _heads(arch, kind, perturbed=True)
    adaptive = DynamicTree(top_k=3, depth=4, budget=12, adaptive=True)
    sizes = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        generator = SpeculativeGenerator(_model(arch), heads, cost_curve=curve)
        for tree in (adaptive, None):  # explicit, and the generator's default
            result = generator.generate(PROMPT, _greedy(tree))
            assert result.token_ids == list(_vanilla(arch)), f"{name} {tree}"
            sizes[name, tree is None] = [s.tree_size for s in result.stats.steps]
    assert all(size == 1 for size in sizes["steep", False])  # only the root: plain decoding
    assert all(size == 1 for size in sizes["steep", True])
    assert max(sizes["flat", False]) == 13  # the whole budget (+ root) when verifying is free


FREE_FOR_ONE_TREE = CostCurve(sizes=(1, 13, 14), seconds=(1.0, 1.0, 1000.0))
"""Free up to one request's whole adaptive tree (12 nodes + root), prohibitive beyond."""


@pytest.mark.parametrize("arch", ARCHS)
def test_adaptive_trees_are_sized_for_the_batch_that_shares_their_forward(arch: str) -> None:
    heads = _heads(arch, "eagle", perturbed=True)
    generator = SpeculativeGenerator(_model(arch), heads, cost_curve=FREE_FOR_ONE_TREE)
    config = _greedy(DynamicTree(top_k=3, depth=4, budget=12, adaptive=True))
    sizes = {}
    for batch in (1, 2, 4):
        stream = generator.stream(PROMPT, config)
        stream.start()
        sizes[batch] = []
        while not stream.done:
            drafted = stream.draft(batch_size=batch)
            sizes[batch].append(drafted.tree.size)
            stream.verify(drafted)
        assert stream.result.token_ids == list(_vanilla(arch)), batch
    # A request's share of a forward over batch x size tokens: free up to 13 tokens in all.
    assert max(sizes[1]) == 13
    assert 1 < max(sizes[2]) <= 6
    assert 1 < max(sizes[4]) <= 3


def test_a_steps_work_after_its_forward_is_measured_for_tree_sizing() -> None:
    heads = _heads("llama", "eagle", perturbed=True)
    generator = SpeculativeGenerator(_model("llama"), heads, cost_curve=FLAT)
    stream = generator.stream(
        PROMPT, _greedy(DynamicTree(top_k=3, depth=4, budget=12, adaptive=True))
    )
    stream.start()
    assert stream.state.overhead_seconds == 0.0
    stream.step()
    assert stream.state.overhead_seconds > 0.0  # verdict, commit and head advance take time


def test_an_adaptive_request_drafts_only_while_drafting_pays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Drafting that costs far more than the accepted drafts save (50 ms a step here): after
    the gate's warm-up the steps decode plainly, trying a draft now and then, and the output is
    the vanilla output. A fixed tree is never gated: it drafts at every step as asked."""
    generator = SpeculativeGenerator(
        _model("llama"), _heads("llama", "eagle", perturbed=True), cost_curve=FLAT
    )
    drafting = generator.drafter.draft_many
    calls = []

    def slow_drafting(requests):
        calls.append(len(requests))
        time.sleep(0.05)
        return drafting(requests)

    monkeypatch.setattr(generator.drafter, "draft_many", slow_drafting)
    config = _greedy(None, new_tokens=40)  # the default: adaptive
    result = generator.generate(PROMPT, config)
    assert result.token_ids == list(_vanilla("llama", 40))
    steps = len(result.stats.steps)
    rates = generator.gate.rates(1)
    assert rates[False] > rates[True]
    assert 3 <= len(calls) <= 6 < steps  # warm-up's 3, an exploration or two; not every step
    calls.clear()
    fixed = generator.generate(PROMPT, _greedy(TREES["dynamic"], new_tokens=40))
    assert fixed.token_ids == result.token_ids
    assert len(calls) == len(fixed.stats.steps)


def test_adaptive_tree_needs_a_cost_curve() -> None:
    generator = SpeculativeGenerator(_model("llama"), _heads("llama", "eagle", perturbed=False))
    tree = DynamicTree(adaptive=True)
    with pytest.raises(ValueError, match="cost curve"):
        generator.generate(PROMPT, _greedy(tree))
