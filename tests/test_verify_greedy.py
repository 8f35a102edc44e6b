"""Greedy verification with hand-made logits: accept all, accept none, partial, ties."""

from __future__ import annotations

import torch
from oracle_drafter import tree_from_parents

from selfspec.tree import Tree
from selfspec.verify import verify_greedy

VOCAB = 16
#            node: 0   1  2  3  4  5  6  7
PARENTS = (-1, 0, 0, 1, 1, 2, 3, 4)
TOKENS = (2, 5, 7, 8, 9, 8, 4, 4)
# Depth 1: 1 (5), 2 (7).  Depth 2: 3 (8), 4 (9) under 1; 5 (8) under 2.  Depth 3: 6 (4) under 3,
# 7 (4) under 4.


def _logits_with_argmax(argmax: dict[int, int], size: int, seed: int = 0) -> torch.Tensor:
    """Random logits # [size, vocab] whose argmax at node n is argmax[n] (a clear margin)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(size, VOCAB, generator=generator)
    for node, token in argmax.items():
        logits[node, token] = logits[node].max() + 1.0
    return logits


def _verify(tree: Tree, argmax: dict[int, int]) -> tuple[list[int], int]:
    logits = _logits_with_argmax(argmax, tree.size)
    verdict = verify_greedy(tree, tree.ancestors(), logits)
    return verdict.accepted.tolist(), verdict.bonus


def test_accept_all_takes_the_deepest_path_and_bonus_at_the_leaf() -> None:
    tree = tree_from_parents(PARENTS, TOKENS)
    accepted, bonus = _verify(tree, {0: 5, 1: 8, 3: 4, 6: 11})
    assert accepted == [0, 1, 3, 6]
    assert bonus == 11


def test_accept_all_on_a_chain() -> None:
    chain = tree_from_parents((-1, 0, 1, 2), (3, 10, 12, 14))
    accepted, bonus = _verify(chain, {0: 10, 1: 12, 2: 14, 3: 6})
    assert accepted == [0, 1, 2, 3]
    assert bonus == 6


def test_accept_none_bonus_is_root_argmax() -> None:
    tree = tree_from_parents(PARENTS, TOKENS)
    accepted, bonus = _verify(tree, {0: 3, 1: 8, 3: 4})  # deeper matches don't help
    assert accepted == [0]
    assert bonus == 3
    verdict = verify_greedy(tree, tree.ancestors(), _logits_with_argmax({0: 3}, tree.size))
    assert verdict.num_drafted_accepted == 0


def test_partial_stops_at_first_mismatch() -> None:
    tree = tree_from_parents(PARENTS, TOKENS)
    # 5 matches at the root, 8 matches at node 1, but node 3 predicts 13, not 4.
    accepted, bonus = _verify(tree, {0: 5, 1: 8, 3: 13})
    assert accepted == [0, 1, 3]
    assert bonus == 13


def test_partial_through_a_later_sibling_is_non_contiguous() -> None:
    tree = tree_from_parents(PARENTS, TOKENS)
    # Root predicts 7 (node 2, the second sibling), node 2 predicts 8 (node 5, a leaf).
    accepted, bonus = _verify(tree, {0: 7, 2: 8, 5: 1})
    assert accepted == [0, 2, 5]
    assert bonus == 1
    # Node 4 (token 9) under node 1: a second-ranked grandchild.
    accepted, bonus = _verify(tree, {0: 5, 1: 9, 4: 4, 7: 0})
    assert accepted == [0, 1, 4, 7]
    assert bonus == 0


def test_a_matching_child_of_a_rejected_node_is_not_accepted() -> None:
    tree = tree_from_parents(PARENTS, TOKENS)
    # Node 3 (token 8) would match node 1's argmax, but node 1 itself is rejected.
    accepted, bonus = _verify(tree, {0: 7, 1: 8, 2: 15})
    assert accepted == [0, 2]
    assert bonus == 15


def test_tie_between_equally_deep_paths_takes_the_lowest_index() -> None:
    # Duplicate tokens make two depth-3 paths match: 0-1-3-6 and 0-1-4-7 with node 4 also 8.
    tokens = (2, 5, 7, 8, 8, 8, 4, 4)
    tree = tree_from_parents(PARENTS, tokens)
    accepted, bonus = _verify(tree, {0: 5, 1: 8, 3: 4, 4: 4, 6: 9, 7: 10})
    assert accepted == [0, 1, 3, 6]
    assert bonus == 9
    # Break the first path: the second one wins, so the rule is "deepest", not "first".
    accepted, bonus = _verify(tree, {0: 5, 1: 8, 3: 12, 4: 4, 6: 9, 7: 10})
    assert accepted == [0, 1, 4, 7]
    assert bonus == 10


def test_root_only_tree() -> None:
    tree = tree_from_parents((-1,), (4,))
    accepted, bonus = _verify(tree, {0: 9})
    assert accepted == [0]
    assert bonus == 9
