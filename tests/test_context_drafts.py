"""Context drafts: the n-gram index, its chain grafted into a tree, lossless decoding with it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from tiny_models import make_lively_model

from selfspec.cost_curve import CostCurve
from selfspec.drafting.context import ChainSource, ContextChain, ContextDrafts, ContextIndex
from selfspec.drafting.grow import DraftPlan, GrowingTree, context_tree, graft_context, grow_tree
from selfspec.drafting.sizing import TreeSizer
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import build_heads, heads_config_for
from selfspec.sampling import SamplingParams
from selfspec.tree import ADAPTIVE_TREE, DraftSampling, DynamicTree, StaticTree


def _chain(index: ContextIndex) -> ContextChain | None:
    """The context's chain of this step (no corpus here), None when there is none."""
    chains = index.propose()
    assert len(chains) <= 1 and all(c.source is ChainSource.CONTEXT for c in chains)
    return chains[0] if chains else None


def test_longest_ngram_wins_and_its_latest_occurrence_proposes() -> None:
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 1, 9, 6, 7, 2, 3, 5, 6, 7]
    chain = _chain(ContextIndex(ContextDrafts(max_tokens=3, max_ngram=3), tokens))
    # "5 6 7" ends at 2 only; "6 7" would have picked the later 6 7 at 6 (followed by 2 3 5).
    assert chain is not None and chain.tokens == (1, 9, 6) and chain.ngram == 3
    assert _chain(ContextIndex(ContextDrafts(max_tokens=3, max_ngram=2), tokens)).tokens == (
        2,
        3,
        5,
    )


def test_no_earlier_occurrence_proposes_nothing_and_the_suffix_itself_never_matches() -> None:
    index = ContextIndex(ContextDrafts(), [1, 2, 3, 4])
    assert _chain(index) is None
    index.extend([2])  # "2" occurred before, followed by 3
    assert _chain(index).tokens == (3, 4, 2)
    assert _chain(ContextIndex(ContextDrafts(), [7])) is None


def test_min_ngram_excludes_short_matches() -> None:
    tokens = [1, 2, 3, 9, 3]
    assert _chain(ContextIndex(ContextDrafts(min_ngram=1), tokens)).tokens == (9, 3)
    assert _chain(ContextIndex(ContextDrafts(min_ngram=2), tokens)) is None


def test_scores_follow_the_observed_match_rates() -> None:
    index = ContextIndex(ContextDrafts(max_tokens=4), [4, 5, 6, 7, 4])
    rates = index.rates[ChainSource.CONTEXT]
    chain = _chain(index)
    assert chain.tokens == (5, 6, 7, 4) and chain.ngram == 1  # "4" alone occurred before
    assert chain.scores == pytest.approx([math.log(0.5) * i for i in (1, 2, 3, 4)])
    index.observe([chain], [5, 6, 7, 4, 5])  # all four matched
    assert rates.first[1].value == pytest.approx(2 / 3)
    assert rates.next.value == pytest.approx((1 + 3) / (2 + 3))
    index.observe([chain], [8])  # the first missed: nothing said about the others
    assert rates.first[1].value == pytest.approx(2 / 4)
    assert rates.next.value == pytest.approx(4 / 5)
    index.observe([chain], [5, 6])  # two matched; nothing committed beyond them to test
    assert rates.first[1].value == pytest.approx(3 / 5)
    assert rates.next.value == pytest.approx(5 / 6)
    assert rates.first[2].value == pytest.approx(0.5)  # other n-gram lengths: the prior
    assert index.rates[ChainSource.CORPUS].next.value == pytest.approx(0.5)  # other sources too
    expected = [math.log(3 / 5) + math.log(5 / 6) * i for i in range(4)]
    assert _chain(index).scores == pytest.approx(expected)


@pytest.mark.parametrize(
    "options",
    [
        dict(max_tokens=0),
        dict(min_ngram=0),
        dict(min_ngram=3, max_ngram=2),
        dict(corpus_min_ngram=5),
    ],
)
def test_invalid_options_are_refused(options: dict) -> None:
    with pytest.raises(ValueError, match="context drafts"):
        ContextDrafts(**options)


def test_generation_config_refuses_a_context_drafts_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="context_drafts"):
        GenerationConfig(context_drafts=8)  # type: ignore[arg-type]


def _drafted_tree() -> GrowingTree:
    """root 0 -> 10 (node 1, -0.1), 11 (node 2, -2.0); 10 -> 12 (node 3, -0.5)."""
    tree = GrowingTree(tokens=[0])
    tree.add(0, 10, 0, -0.1)
    tree.add(0, 11, 1, -2.0)
    tree.add(1, 12, 0, -0.4)
    return tree


def test_graft_shares_drafted_nodes_and_appends_the_rest() -> None:
    tree = _drafted_tree()
    chain = ContextChain(tokens=(10, 13, 14), scores=(-0.3, -0.6, -0.9))
    graft_context(tree, [chain], depth=8)
    assert tree.tokens == [0, 10, 11, 12, 13, 14]
    assert tree.parents == [-1, 0, 0, 1, 1, 4]
    assert tree.depths == [0, 1, 1, 2, 2, 3]
    assert tree.ranks[4] == 1  # after node 3, the drafted child of node 1
    assert tree.scores == pytest.approx([0.0, -0.1, -2.0, -0.5, -0.6, -0.9])
    assert tree.point_mass == [False, False, False, False, True, True]
    for node in range(1, tree.size):  # a child never outscores its parent
        assert tree.scores[node] <= tree.scores[tree.parents[node]]


def test_graft_into_sampled_draws_follows_no_draw() -> None:
    """A draw equal to the chain's token stays a draw with its own score; the chain is appended
    after the drawn siblings, so whether it is there never depends on what they drew."""
    tree = _drafted_tree()
    chain = ContextChain(tokens=(10, 13), scores=(-0.05, -0.6))
    graft_context(tree, [chain], depth=8, sampled=True)
    assert tree.tokens == [0, 10, 11, 12, 10, 13]
    assert tree.parents == [-1, 0, 0, 1, 0, 4]
    assert tree.ranks[4] == 2  # after the root's two drawn children
    assert tree.scores[1] == pytest.approx(-0.1)  # the draw keeps its own score
    assert tree.point_mass == [False, False, False, False, True, True]
    again = ContextChain(tokens=(10, 13, 15), scores=(-0.05, -0.6, -0.7))
    graft_context(tree, [again], depth=8, sampled=True)  # follows the chain nodes only
    assert tree.tokens == [0, 10, 11, 12, 10, 13, 15] and tree.parents[-1] == 5


def test_graft_raises_the_score_of_shared_nodes_and_respects_the_depth_bound() -> None:
    tree = _drafted_tree()
    chain = ContextChain(tokens=(11, 15, 16), scores=(-0.2, -0.4, -0.6))
    graft_context(tree, [chain], depth=2)
    assert tree.tokens == [0, 10, 11, 12, 15]  # 16 would be at depth 3
    assert tree.scores[2] == pytest.approx(-0.2)  # was -2.0 as the heads' draw
    for chains in ([ContextChain((10, 12), (-1.0, -2.0))], []):  # all there already; none
        unchanged = _drafted_tree()
        graft_context(unchanged, chains, depth=4)
        assert unchanged.tokens == _drafted_tree().tokens
        assert unchanged.scores == _drafted_tree().scores


def _uniform_expand(vocab: int):
    def expand(tree: GrowingTree, frontier: list[int]) -> torch.Tensor:
        return torch.zeros(len(frontier), vocab)  # [F, N]: every child equally likely

    return expand


def test_a_grafted_chain_competes_for_the_budget_and_makes_point_mass_proposals() -> None:
    vocab = 50
    spec = DynamicTree(top_k=4, depth=3, budget=6)
    chain = ContextChain(tokens=(40, 41, 42), scores=(-0.1, -0.2, -0.3))
    sampled = DraftPlan(
        tree=spec,
        sampling=DraftSampling.WITHOUT_REPLACEMENT,
        params=SamplingParams(temperature=1.0),
        context=(chain,),
    )
    tree = grow_tree(0, _uniform_expand(vocab), sampled, torch.Generator().manual_seed(0))
    assert tree.size == 1 + spec.budget
    # The chain (scores near 0) outranks every uniform draw (log 1/50 per depth); the tree
    # stays sampled, the chain's nodes marked as point masses after the drawn siblings.
    assert tree.sampling is DraftSampling.WITHOUT_REPLACEMENT
    assert tree.point_mass is not None
    assert tree.tokens[tree.point_mass].tolist() == [40, 41, 42]
    root_children = (tree.parents == 0).nonzero().squeeze(1).tolist()
    assert tree.point_mass[root_children].tolist() == [False] * (len(root_children) - 1) + [True]
    plain = grow_tree(
        0, _uniform_expand(vocab), DraftPlan(tree=StaticTree.chain(2), context=(chain,)), None
    )
    assert plain.tokens.tolist()[-2:] == [40, 41]  # static trees: the chain, to their depth


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_context_drafts_are_lossless_and_accepted_where_text_repeats(arch: str, kind: str) -> None:
    """The lively tiny models' greedy text repeats itself; with untrained heads, chains copied
    from it are accepted beyond what the heads draft, and the output stays the vanilla output."""
    model = make_lively_model(arch)
    generator = SpeculativeGenerator(model, build_heads(heads_config_for(model, kind)).eval())
    prompt = [1, 23, 5, 61, 8, 30]
    config = GenerationConfig(max_new_tokens=24, stop_token_ids=(), tree=DynamicTree(3, 4, 12))
    vanilla = generator.generate(prompt, replace(config, speculate=False)).token_ids
    heads_only = generator.generate(prompt, replace(config, context_drafts=None))
    with_context = generator.generate(prompt, config)
    assert heads_only.token_ids == vanilla
    assert with_context.token_ids == vanilla
    assert with_context.stats.tau > heads_only.stats.tau


def test_context_drafts_keep_seeded_sampling_repeatable() -> None:
    model = make_lively_model("llama")
    generator = SpeculativeGenerator(model, build_heads(heads_config_for(model, "eagle")).eval())
    config = GenerationConfig(
        max_new_tokens=24, stop_token_ids=(), sampling=SamplingParams(temperature=0.8), seed=5
    )
    first = generator.generate([1, 23, 5, 61, 8, 30], config).token_ids
    assert generator.generate([1, 23, 5, 61, 8, 30], config).token_ids == first


@pytest.mark.parametrize(("seconds", "kept"), [((1.0, 1.0), 3), ((1.0, 1000.0), 0)])
def test_a_context_tree_keeps_what_pays_for_its_verification(seconds, kept) -> None:
    """A step whose heads rest verifies the root and the chain; an adaptive plan's sizer keeps
    all of it where verification is flat and none where a second token costs 1000x."""
    chain = ContextChain(tokens=(7, 8, 9, 10), scores=(-0.5, -0.8, -1.1, -1.4))
    sizer = TreeSizer(CostCurve(sizes=(1, 2), seconds=seconds))
    adaptive = DraftPlan(tree=DynamicTree(2, 3, 8, adaptive=True), sizer=sizer, context=(chain,))
    tree = context_tree(5, adaptive, torch.device("cpu"))
    assert tree.tokens.tolist() == [5, 7, 8, 9][: kept + 1]
    fixed = context_tree(
        5, DraftPlan(tree=DynamicTree(2, 3, 8), context=(chain,)), torch.device("cpu")
    )
    assert fixed.tokens.tolist() == [5, 7, 8, 9] and fixed.sampling is DraftSampling.TOP_K


def test_a_plain_step_offers_its_chains_alone_but_not_in_a_batch() -> None:
    """A step whose heads rest (the gate's plain round) verifies its context chains when the
    request runs alone, sized by its own sizer; in a batch it is the root alone, with no sizer
    for the round's joint sizing (chains would pad every row and rarely pay there)."""
    model = make_lively_model("llama")
    flat = CostCurve(sizes=(1, 64), seconds=(1.0, 1.0))
    heads = build_heads(heads_config_for(model, "eagle")).eval()
    generator = SpeculativeGenerator(model, heads, cost_curve=flat)
    config = GenerationConfig(max_new_tokens=24, stop_token_ids=(), tree=ADAPTIVE_TREE)
    stream = generator.stream([1, 23, 5, 61, 8, 30], config)
    stream.start()
    with_chains = 0
    while not stream.done:
        in_batch = stream.draft(batch_size=2, speculate=False, joint=True)
        assert not in_batch.drafted and in_batch.tree.size == 1
        assert in_batch.sizer is None and not in_batch.context
        alone = stream.draft(batch_size=1, speculate=False)
        assert not alone.drafted
        if alone.tree.size > 1:
            with_chains += 1
            assert alone.context
        stream.verify(alone)
    assert with_chains
