"""Test helpers: hand-built trees, and an oracle drafter that knows the target's continuation.

`OracleDrafter` satisfies `selfspec.drafting.base.Drafter`. It drafts through the real
`grow_tree`, so the trees it makes are shaped exactly like the heads' trees; only the draft
logits are rigged: on the path of the true (vanilla greedy) continuation the correct next token
gets a chosen rank, and a wrong token may be placed above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.drafting.base import AdvanceRequest, DraftRequest
from selfspec.drafting.grow import DraftPlan, GrowingTree, grow_tree
from selfspec.tree import DraftSampling, Tree


def tree_from_parents(
    parents: Sequence[int],
    tokens: Sequence[int],
    sampling: DraftSampling = DraftSampling.TOP_K,
) -> Tree:
    """A top-k style Tree from parent links (parents first, siblings in draw order)."""
    size = len(parents)
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
    depths = [0] * size
    ranks = [0] * size
    children: dict[int, list[int]] = {}
    for node in range(1, size):
        depths[node] = depths[parents[node]] + 1
        siblings = children.setdefault(parents[node], [])
        ranks[node] = len(siblings)
        siblings.append(node)
    expanded = sorted(children)
    row_of = {node: row for row, node in enumerate(expanded)}
    width = max((len(c) for c in children.values()), default=1)
    draws = torch.full((max(len(expanded), 1), width), -1, dtype=torch.long)
    for node, kids in children.items():
        draws[row_of[node], : len(kids)] = torch.tensor([tokens[k] for k in kids])

    def column(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long)

    return Tree(
        tokens=column(tokens),
        parents=column(parents),
        depths=column(depths),
        draw_ranks=column(ranks),
        expanded_row=column([row_of.get(n, -1) for n in range(size)]),
        draft_probs=torch.zeros(0, 1),
        draws=draws,
        sampling=sampling,
    )


@dataclass
class OracleState:
    position: int
    """Index into the continuation of the current root (the last committed token)."""


class OracleDrafter:
    """Drafts the known continuation; ``correct_rank[d - 1]`` is the rank of the true token among
    the children of an on-path node at depth d - 1 (ranks above it get wrong tokens)."""

    def __init__(
        self,
        continuation: Sequence[int],
        vocab_size: int,
        correct_rank: Sequence[int] = (),
    ) -> None:
        self.continuation = list(continuation)
        """The vanilla greedy output after the prompt, first token included."""
        self.vocab_size = vocab_size
        self.correct_rank = tuple(correct_rank)
        self.drafted_trees: list[Tree] = []

    def start(
        self, prompt_features: torch.Tensor, prompt_tokens: torch.Tensor, first_token: int
    ) -> OracleState:
        assert first_token == self.continuation[0], "the target's first token is not vanilla's"
        return OracleState(position=0)

    def draft(
        self,
        state: OracleState,
        root_token: int,
        plan: DraftPlan,
        generator: torch.Generator | None,
    ) -> Tree:
        if state.position < len(self.continuation):
            assert root_token == self.continuation[state.position], "the loop lost track"

        def expand(tree: GrowingTree, frontier: list[int]) -> torch.Tensor:
            return torch.stack([self._logits(tree, node, state.position) for node in frontier])

        tree = grow_tree(root_token, expand, plan, generator)
        self.drafted_trees.append(tree)
        return tree

    def draft_many(self, requests: Sequence[DraftRequest]) -> list[Tree]:
        return [self.draft(r.state, r.root_token, r.plan, r.generator) for r in requests]

    def advance(
        self,
        state: OracleState,
        accepted_features: torch.Tensor,
        accepted_tokens: torch.Tensor,
        bonus: int,
    ) -> None:
        state.position += int(accepted_tokens.shape[0])

    def advance_many(self, requests: Sequence[AdvanceRequest]) -> None:
        for r in requests:
            self.advance(r.state, r.accepted_features, r.accepted_tokens, r.bonus)

    def _logits(self, tree: GrowingTree, node: int, root_position: int) -> torch.Tensor:
        """Draft logits for the children of `node`. # [vocab]"""
        path = []
        walk = node
        while walk > 0:
            path.append(tree.tokens[walk])
            walk = tree.parents[walk]
        path.reverse()  # drafted tokens root-first, root excluded
        depth = len(path)
        start = root_position + 1
        truth = self.continuation[start : start + depth + 1]
        # A fixed, arbitrary ordering of all tokens for the off-path ranks.
        logits = -torch.arange(self.vocab_size, dtype=torch.float32) * 0.01  # [vocab]
        if len(truth) == depth + 1 and path == truth[:depth]:
            correct = truth[depth]
            rank = self.correct_rank[depth] if depth < len(self.correct_rank) else 0
            wrong = [t for t in range(self.vocab_size) if t != correct][:rank]
            for above, token in enumerate(wrong):
                logits[token] = 20.0 - above
            logits[correct] = 20.0 - rank
        return logits
