"""EAGLE drafting: the head runs autoregressively over the tree, one forward per depth.

Cache convention: entry j of the EAGLE cache holds the pair (feature_j, token_{j+1}) at the
position of token_{j+1}. After a step the cache covers every committed token up to the root of
the next tree, so drafting starts from ``root_feature``, the head's prediction at the root.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from selfspec.drafting.base import AdvanceRequest, DraftRequest
from selfspec.drafting.fused_head import FusedEagleHead
from selfspec.drafting.grow import DraftPlan, GrowingTree, Growth, growth
from selfspec.drafting.projection import DraftProjection
from selfspec.heads.draft_vocab import draft_vocab_of
from selfspec.heads.eagle import EagleCache, EagleHead
from selfspec.target_forward import TargetForward
from selfspec.tree import Tree


@dataclass
class EagleState:
    root_feature: torch.Tensor  # [H] predicted feature at the root position
    cache: EagleCache = field(default_factory=EagleCache)


class EagleDrafter:
    def __init__(self, head: EagleHead, target: TargetForward) -> None:
        self.head = head
        self.target = target
        self.projection = DraftProjection(target.lm_head, draft_vocab_of(head), head)
        self.fused = FusedEagleHead(head)  # the head's layers in one C++ call where it can

    def start(
        self, prompt_features: torch.Tensor, prompt_tokens: torch.Tensor, first_token: int
    ) -> EagleState:
        state = EagleState(root_feature=prompt_features[-1])
        first = torch.tensor([first_token], device=prompt_tokens.device)
        self._append(
            state, self.head_features(prompt_features), torch.cat([prompt_tokens[1:], first])
        )
        return state

    def advance(
        self,
        state: EagleState,
        accepted_features: torch.Tensor,
        accepted_tokens: torch.Tensor,
        bonus: int,
    ) -> None:
        self.advance_many([AdvanceRequest(state, accepted_features, accepted_tokens, bonus)])

    def advance_many(self, requests: Sequence[AdvanceRequest]) -> None:
        """Each request's accepted path committed to its draft state, as ``advance`` commits it;
        on the fused path all paths go through the head in one call (each row over its own
        cache, padded to the longest path, the padding's entries dropped afterwards)."""
        pairs = [  # (state, head features # [A, H], next tokens # [A])
            (
                request.state,
                self.head_features(request.accepted_features),
                torch.cat(
                    [
                        request.accepted_tokens[1:],
                        request.accepted_tokens.new_tensor([request.bonus]),
                    ]
                ),
            )
            for request in requests
        ]
        if len(pairs) > 1 and self._append_rows(pairs):
            return
        for state, features, next_tokens in pairs:
            self._append(state, features, next_tokens)

    def head_features(self, features: torch.Tensor) -> torch.Tensor:
        """The decoding loop's features as the head reads them. # [A, F] -> [A, H]"""
        return features

    def _append(self, state: EagleState, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Commit pairs (feature_j, token_{j+1}). features: # [A, H], next_tokens: # [A]"""
        start = state.cache.length + 1
        positions = torch.arange(start, start + next_tokens.shape[0], device=next_tokens.device)
        predicted = self.fused(
            self.target.embed(next_tokens)[None], features[None], positions[None], None, state.cache
        )  # [1, A, H]
        state.root_feature = predicted[0, -1]

    def _append_rows(self, pairs: list[tuple[EagleState, torch.Tensor, torch.Tensor]]) -> bool:
        """``_append`` for every pair in one fused head call; False (nothing written) where the
        fused path cannot run."""
        width = max(int(tokens.shape[0]) for _, _, tokens in pairs)
        lengths = [state.cache.length for state, _, _ in pairs]
        device = pairs[0][2].device
        positions = [
            torch.arange(length + 1, length + 1 + tokens.shape[0], device=device)
            for length, (_, _, tokens) in zip(lengths, pairs, strict=True)
        ]
        out = self.fused.rows(
            self.target.embed(_padded([tokens for _, _, tokens in pairs], width)),
            _padded([features for _, features, _ in pairs], width),
            _padded(positions, width),
            [None] * len(pairs),  # causal: a row never sees the padding after it
            [state.cache for state, _, _ in pairs],
        )  # [B, width, H]
        if out is None:
            return False
        for row, ((state, _, tokens), length) in enumerate(zip(pairs, lengths, strict=True)):
            state.cache.crop(length + int(tokens.shape[0]))  # the padding's entries
            state.root_feature = out[row, int(tokens.shape[0]) - 1]
        return True

    def draft(
        self, state: EagleState, root_token: int, plan: DraftPlan, generator: torch.Generator | None
    ) -> Tree:
        return self.draft_many([DraftRequest(state, root_token, plan, generator)])[0]

    def draft_many(self, requests: Sequence[DraftRequest]) -> list[Tree]:
        """The requests' trees grown in lock step: each depth's frontiers of every request go
        through the head in one call (on the fused path: each row over its own cache, padded to
        the widest frontier) and through the projection in one call. Each tree is the one its
        request would draft alone (the fused kernels are row-invariant); the adaptive sizer
        prices each request's drafting at its share of the batch's time."""
        started = time.perf_counter()

        def share() -> float:
            return (time.perf_counter() - started) / len(requests)

        work = [
            _Growing(
                request.state,
                request.state.cache.length,
                growth(request.root_token, request.plan, request.generator, self.projection, share),
            )
            for request in requests
        ]
        try:
            for item in work:
                item.pending = next(item.growth)
            while active := [item for item in work if item.pending is not None]:
                for item, logits in zip(active, self._score(active), strict=True):
                    try:
                        item.pending = item.growth.send(logits)
                    except StopIteration as finished:
                        item.pending, item.tree = None, finished.value
        finally:
            for item in work:
                item.state.cache.crop(item.committed)  # drafted entries never outlive the step
        return [item.tree for item in work]

    def _score(self, active: list[_Growing]) -> list[torch.Tensor]:
        """Draft logits for each growing tree's pending frontier # [F_b, N] each: a frontier at
        the root reads the state's root feature; deeper ones run the head over their parents'
        predicted features, one call for all requests, then one projection."""
        deeper = [item for item in active if item.pending[1] != [0]]
        if deeper:
            predicted = self._head_rows(deeper)  # [F_b, H] each
            for item, out in zip(deeper, predicted, strict=True):
                for row, node in enumerate(item.pending[1]):
                    item.predicted[node] = out[row]
        hidden = [  # [F_b, H] each
            item.state.root_feature[None]
            if item.pending[1] == [0]
            else torch.stack([item.predicted[node] for node in item.pending[1]])
            for item in active
        ]
        sizes = [rows.shape[0] for rows in hidden]
        return list(self.projection.logits(torch.cat(hidden)).split(sizes))  # [F_b, N] each

    def _head_rows(self, deeper: list[_Growing]) -> list[torch.Tensor]:
        """The head over each item's frontier (children's tokens at their parents' predicted
        features), each over its own cache; the drafted entries' slots are recorded."""
        inputs = [item.frontier_inputs(self.target.device) for item in deeper]
        width = max(len(item.pending[1]) for item in deeper)
        out = None
        if len(deeper) > 1:
            out = self.fused.rows(
                self.target.embed(_padded([t for t, _, _ in inputs], width)),
                _padded([f for _, f, _ in inputs], width),
                _padded([p for _, _, p in inputs], width),
                [item.attend(width) for item in deeper],
                [item.state.cache for item in deeper],
            )  # [B, width, H]
        if out is not None:
            for item in deeper:
                item.drafted(width)
            return [out[b, : len(item.pending[1])] for b, item in enumerate(deeper)]
        predicted = []
        for item, (tokens, features, positions) in zip(deeper, inputs, strict=True):
            size = len(item.pending[1])
            predicted.append(
                self.fused(
                    self.target.embed(tokens)[None],
                    features[None],
                    positions[None],
                    item.attend(size),
                    item.state.cache,
                )[0]
            )
            item.drafted(size)
        return predicted


@dataclass
class _Growing:
    """One request's tree while ``EagleDrafter.draft_many`` grows it."""

    state: EagleState
    committed: int  # the cache's committed entries; drafted ones follow
    growth: Growth
    pending: tuple[GrowingTree, list[int]] | None = None  # the frontier awaiting draft logits
    tree: Tree | None = None  # once grown
    predicted: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> [H]
    slot_nodes: list[int] = field(default_factory=list)
    """The tree node held by each cache slot after ``committed`` (-1: a padding row's)."""

    def __post_init__(self) -> None:
        self.predicted[0] = self.state.root_feature

    def frontier_inputs(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The frontier's tokens # [F], their parents' predicted features # [F, H] and their
        positions # [F]."""
        tree, frontier = self.pending
        tokens = torch.tensor([tree.tokens[n] for n in frontier], device=device)
        features = torch.stack([self.predicted[tree.parents[n]] for n in frontier])
        positions = torch.tensor([self.committed + tree.depths[n] for n in frontier], device=device)
        return tokens, features, positions

    def attend(self, width: int) -> torch.Tensor:
        """Each frontier node sees the committed cache, its drafted ancestors and itself; rows
        past the frontier (padding up to ``width``) see only themselves.
        # [1, 1, width, committed + drafted + width] bool"""
        tree, frontier = self.pending
        slot_of = {node: slot for slot, node in enumerate(self.slot_nodes) if node >= 0}
        drafted = self.committed + len(self.slot_nodes)
        # Filled element by element on the host, then copied to the device once (on a GPU, one
        # small copy instead of a kernel launch per element).
        attend = torch.zeros(width, drafted + width, dtype=torch.bool, device="cpu")
        attend[: len(frontier), : self.committed] = True
        for row in range(width):
            attend[row, drafted + row] = True
        for row, node in enumerate(frontier):
            ancestor = tree.parents[node]
            while ancestor > 0:  # the root's entry is the last committed slot
                attend[row, self.committed + slot_of[ancestor]] = True
                ancestor = tree.parents[ancestor]
        return attend.to(self.state.root_feature.device)[None, None]

    def drafted(self, width: int) -> None:
        """The head wrote ``width`` cache entries for the pending frontier (padding after it)."""
        frontier = self.pending[1]
        self.slot_nodes.extend([*frontier, *[-1] * (width - len(frontier))])


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[F_b, ...] each -> [B, width, ...], zeros after each row's own F_b."""
    out = rows[0].new_zeros(len(rows), width, *rows[0].shape[1:])
    for b, row in enumerate(rows):
        out[b, : row.shape[0]] = row
    return out
