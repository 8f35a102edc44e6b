"""Trees: static node order, ancestors, tree buffers, and tree-forward parity with HF models.

The parity test is the foundation of lossless verification: one target forward over the whole
tree (4D tree mask over a DynamicCache holding the prompt) must give, at every node, the logits of
running that node's root-to-node path alone.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from oracle_drafter import tree_from_parents
from tiny_models import ARCHS, VOCAB_SIZE, tiny_config
from transformers import AutoModelForCausalLM, PreTrainedModel

from selfspec.drafting.grow import DraftPlan, grow_tree
from selfspec.sampling import SamplingParams
from selfspec.target_forward import TargetForward
from selfspec.tree import (
    DEFAULT_STATIC_TREE,
    DraftSampling,
    DynamicTree,
    StaticTree,
    prune,
    tree_buffers,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run ~10x faster on one thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# A branching tree of depth 3 with 9 nodes, siblings at every level, nodes not in DFS order.
PARENTS = (-1, 0, 0, 0, 1, 1, 2, 4, 6)
TOKENS = (7, 12, 40, 3, 55, 12, 9, 81, 40)


def _brute_ancestors(parents: tuple[int, ...]) -> torch.Tensor:
    size = len(parents)
    expected = torch.zeros(size, size, dtype=torch.bool)
    for node in range(size):
        walk = node
        while walk >= 0:
            expected[node, walk] = True
            walk = parents[walk]
    return expected


# -- static trees --------------------------------------------------------------------------------


def test_static_nodes_parents_first_siblings_by_rank() -> None:
    tree = StaticTree(paths=((1, 0), (0, 0, 1), (0, 1), (2,)))
    assert tree.nodes() == [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 1)]
    assert tree.depth == 3


def test_static_nodes_of_default_tree_are_a_valid_order() -> None:
    nodes = DEFAULT_STATIC_TREE.nodes()
    prefixes = {p[:d] for p in DEFAULT_STATIC_TREE.paths for d in range(1, len(p) + 1)}
    assert len(nodes) == len(set(nodes)) and set(nodes) == prefixes
    seen: set[tuple[int, ...]] = set()
    for node in nodes:
        if len(node) > 1:
            assert node[:-1] in seen, f"{node} listed before its parent"
        seen.add(node)
    # Siblings appear in rank order.
    for a, b in zip(nodes, nodes[1:], strict=False):
        if len(a) == len(b) and a[:-1] == b[:-1]:
            assert a[-1] < b[-1]


def test_chain_and_full_shapes() -> None:
    assert StaticTree.chain(3).nodes() == [(0,), (0, 0), (0, 0, 0)]
    assert len(StaticTree.full((3, 2)).nodes()) == 3 + 6
    assert StaticTree.full((3, 2)).depth == 2


@pytest.mark.parametrize("paths", [(), ((),), ((0, -1),), ((0, "1"),)])
def test_static_tree_that_is_not_a_tree_is_rejected(paths: tuple) -> None:
    with pytest.raises(ValueError, match="path"):
        StaticTree(paths=paths)


@pytest.mark.parametrize("field", ["top_k", "depth", "budget"])
def test_dynamic_tree_invalid_names_field(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DynamicTree(**{field: 0})


# -- Tree and buffers ---------------------------------------------------------------------------


def test_ancestors_match_brute_force() -> None:
    tree = tree_from_parents(PARENTS, TOKENS)
    assert torch.equal(tree.ancestors(), _brute_ancestors(PARENTS))
    assert tree.children() == [[1, 2, 3], [4, 5], [6], [], [7], [], [8], [], []]


def test_ancestors_of_a_deep_chain() -> None:
    parents = (-1, *range(7))  # depth 7
    tree = tree_from_parents(parents, tuple(range(8)))
    assert torch.equal(tree.ancestors(), torch.ones(8, 8, dtype=torch.bool).tril())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_buffers_mask_and_positions(dtype: torch.dtype) -> None:
    tree = tree_from_parents(PARENTS, TOKENS)
    cache_len = 5
    buffers = tree_buffers(tree, cache_len, dtype)
    size = len(PARENTS)
    assert buffers.attention_mask.shape == (1, 1, size, cache_len + size)
    assert buffers.attention_mask.dtype == dtype
    allowed = torch.cat(
        [torch.ones(size, cache_len, dtype=torch.bool), _brute_ancestors(PARENTS)], dim=1
    )
    mask = buffers.attention_mask[0, 0]
    assert (mask[allowed] == 0).all()
    assert (mask[~allowed] == torch.finfo(dtype).min).all()
    depths = torch.tensor([0, 1, 1, 1, 2, 2, 2, 3, 3])
    assert torch.equal(buffers.position_ids, (depths + cache_len)[None])
    assert torch.equal(buffers.ancestors, _brute_ancestors(PARENTS))


# -- tree-forward parity ------------------------------------------------------------------------


def _model(arch: str, attn: str) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            tiny_config(arch), attn_implementation=attn, dtype=torch.float32
        )
    return model.eval()


def _parity_trees() -> list:
    """The hand-built tree, and a grown DEFAULT_STATIC_TREE (26 drafted nodes, depth 4)."""
    generator = torch.Generator().manual_seed(3)
    table = torch.randn(VOCAB_SIZE, VOCAB_SIZE, generator=generator)  # token -> draft logits

    def expand(tree, frontier: list[int]) -> torch.Tensor:
        return table[torch.tensor([tree.tokens[n] for n in frontier])]  # [F, vocab]

    grown = grow_tree(17, expand, DraftPlan(tree=DEFAULT_STATIC_TREE), None)
    return [tree_from_parents(PARENTS, TOKENS), grown]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_forward_matches_each_path_alone(arch: str, attn: str) -> None:
    model = _model(arch, attn)
    target = TargetForward(model)
    prompt = torch.tensor([[1, 23, 5, 61, 8, 30]])  # [1, S]
    prompt_len = prompt.shape[1]
    with torch.no_grad():
        for tree in _parity_trees():
            cache = target.new_cache()
            target.features(prompt, torch.arange(prompt_len)[None], cache)
            buffers = tree_buffers(tree, prompt_len, target.dtype)
            features = target.features(
                tree.tokens[None], buffers.position_ids, cache, buffers.attention_mask
            )  # [1, T, H]
            tree_logits = target.logits(features)[0]  # [T, vocab]
            assert cache.get_seq_length() == prompt_len + tree.size
            # Each leaf's path run alone (causally) gives the logits of every node on it; paths
            # of equal length are batched, which needs no padding.
            ancestors = tree.ancestors()
            leaves = [n for n, kids in enumerate(tree.children()) if not kids]
            checked = set()
            for length in sorted({int(tree.depths[leaf]) + 1 for leaf in leaves}):
                group = [leaf for leaf in leaves if int(tree.depths[leaf]) + 1 == length]
                paths = torch.stack([ancestors[leaf].nonzero().squeeze(1) for leaf in group])
                inputs = torch.cat([prompt.expand(len(group), -1), tree.tokens[paths]], dim=1)
                alone = model(input_ids=inputs).logits[:, prompt_len:]  # [G, L, vocab]
                for row, leaf_path in enumerate(paths.tolist()):
                    for step, node in enumerate(leaf_path):
                        diff = (tree_logits[node] - alone[row, step]).abs().max().item()
                        assert diff < 1e-4, f"{arch}/{attn}: node {node} differs by {diff}"
                        checked.add(node)
            assert checked == set(range(tree.size))


def test_prune_keeps_the_best_scored_nodes_with_their_parents() -> None:
    """The root and the best ``count`` drafted nodes by cumulative log-prob (ties: creation
    order), re-indexed; a pruned sampled tree falls back to the point-mass rule."""
    # Scores never rise along a path: node 7 (under 4 under 1) scores below its ancestors.
    scores = torch.tensor([0.0, -0.1, -0.5, -2.0, -0.3, -1.0, -0.5, -0.4, -3.0])
    sampled = replace(
        tree_from_parents(PARENTS, TOKENS, DraftSampling.WITHOUT_REPLACEMENT),
        draft_probs=torch.full((5, VOCAB_SIZE), 1.0 / VOCAB_SIZE),
        scores=scores,
    )
    pruned = prune(sampled, 4)  # nodes 1 (-0.1), 4 (-0.3), 7 (-0.4), then 2 before 6 (tie -0.5)
    assert pruned.tokens.tolist() == [TOKENS[n] for n in (0, 1, 2, 4, 7)]
    assert pruned.parents.tolist() == [-1, 0, 0, 1, 3]  # 4's parent 1 -> 1; 7's parent 4 -> 3
    assert pruned.depths.tolist() == [0, 1, 1, 2, 3]
    assert pruned.scores.tolist() == pytest.approx([0.0, -0.1, -0.5, -0.3, -0.4])
    assert pruned.sampling is DraftSampling.TOP_K and pruned.draft_probs.shape == (0, VOCAB_SIZE)
    assert torch.equal(pruned.draws, sampled.draws)
    kept = (0, 1, 2, 4, 7)
    assert pruned.draw_ranks.tolist() == [sampled.draw_ranks[n].item() for n in kept]
    assert pruned.expanded_row.tolist() == [sampled.expanded_row[n].item() for n in kept]
    assert prune(sampled, 0).tokens.tolist() == [TOKENS[0]]
    assert prune(sampled, 8) is sampled and prune(sampled, 20) is sampled
    with pytest.raises(ValueError, match="count"):
        prune(sampled, -1)
    with pytest.raises(ValueError, match="scores"):
        prune(replace(sampled, scores=None), 2)


def test_prune_as_drawn_keeps_a_sampled_tree_sampled() -> None:
    """A count chosen by a stopping rule (``joint_keep(as_drawn=True)``) keeps the draws
    samples of their proposals; any other count makes them point masses."""
    plan = DraftPlan(
        tree=DynamicTree(top_k=3, depth=3, budget=10),
        sampling=DraftSampling.WITHOUT_REPLACEMENT,
        params=SamplingParams(temperature=1.0),
    )

    def expand(tree, frontier):
        return torch.randn(len(frontier), VOCAB_SIZE, generator=torch.Generator().manual_seed(1))

    tree = grow_tree(0, expand, plan, torch.Generator().manual_seed(0))
    assert tree.sampling is DraftSampling.WITHOUT_REPLACEMENT and tree.size == 11
    kept = prune(tree, 4, as_drawn=True)
    assert kept.size == 5 and kept.sampling is DraftSampling.WITHOUT_REPLACEMENT
    assert kept.draft_probs.shape == tree.draft_probs.shape
    best = sorted(range(1, tree.size), key=lambda n: -float(tree.scores[n]))[:4]
    assert kept.tokens.tolist() == tree.tokens[[0, *sorted(best)]].tolist()
    cut = prune(tree, 4)
    assert cut.sampling is DraftSampling.TOP_K and cut.draft_probs.shape[0] == 0
