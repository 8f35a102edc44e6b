"""EAGLE drafting: the head runs autoregressively over the tree, one forward per depth.

Cache convention: entry j of the EAGLE cache holds the pair (feature_j, token_{j+1}) at the
position of token_{j+1}. After a step the cache covers every committed token up to the root of
the next tree, so drafting starts from ``root_feature``, the head's prediction at the root.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.drafting.fused_head import FusedEagleHead
from selfspec.drafting.grow import DraftPlan, GrowingTree, grow_tree
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
        self._append(state, prompt_features, torch.cat([prompt_tokens[1:], first]))
        return state

    def advance(
        self,
        state: EagleState,
        accepted_features: torch.Tensor,
        accepted_tokens: torch.Tensor,
        bonus: int,
    ) -> None:
        bonus_token = torch.tensor([bonus], device=accepted_tokens.device)
        self._append(state, accepted_features, torch.cat([accepted_tokens[1:], bonus_token]))

    def _append(self, state: EagleState, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Commit pairs (feature_j, token_{j+1}). features: # [A, H], next_tokens: # [A]"""
        start = state.cache.length + 1
        positions = torch.arange(start, start + next_tokens.shape[0], device=next_tokens.device)
        predicted = self.fused(
            self.target.embed(next_tokens)[None], features[None], positions[None], None, state.cache
        )  # [1, A, H]
        state.root_feature = predicted[0, -1]

    def draft(
        self, state: EagleState, root_token: int, plan: DraftPlan, generator: torch.Generator | None
    ) -> Tree:
        committed = state.cache.length
        device = state.root_feature.device
        predicted: dict[int, torch.Tensor] = {0: state.root_feature}  # node -> [H]
        slot_nodes: list[int] = []  # tree node held by each cache slot after `committed`

        def expand(tree: GrowingTree, frontier: list[int]) -> torch.Tensor:
            if frontier == [0]:
                return self.projection.logits(state.root_feature)[None]  # [1, N]
            tokens = torch.tensor([tree.tokens[n] for n in frontier], device=device)
            parent_features = torch.stack([predicted[tree.parents[n]] for n in frontier])  # [F, H]
            positions = torch.tensor([committed + tree.depths[n] for n in frontier], device=device)
            attend = self._tree_attend(tree, frontier, committed, slot_nodes, device)
            out = self.fused(
                self.target.embed(tokens)[None],
                parent_features[None],
                positions[None],
                attend,
                state.cache,
            )[0]  # [F, H]
            for i, node in enumerate(frontier):
                predicted[node] = out[i]
            slot_nodes.extend(frontier)
            return self.projection.logits(out)  # [F, N]

        try:
            return grow_tree(root_token, expand, plan, generator, self.projection)
        finally:
            state.cache.crop(committed)  # drafted entries never outlive the step

    @staticmethod
    def _tree_attend(
        tree: GrowingTree,
        frontier: list[int],
        committed: int,
        slot_nodes: list[int],
        device: torch.device,
    ) -> torch.Tensor:
        """Each frontier node sees the committed cache, its drafted ancestors and itself.
        # [1, 1, F, committed + drafted + F] bool"""
        slot_of = {node: slot for slot, node in enumerate(slot_nodes)}
        width = committed + len(slot_nodes) + len(frontier)
        # Filled element by element on the host, then copied to the device once (on a GPU, one
        # small copy instead of a kernel launch per element).
        attend = torch.zeros(len(frontier), width, dtype=torch.bool, device="cpu")
        attend[:, :committed] = True
        for row, node in enumerate(frontier):
            attend[row, committed + len(slot_nodes) + row] = True
            ancestor = tree.parents[node]
            while ancestor > 0:  # the root's entry is the last committed slot
                attend[row, committed + slot_of[ancestor]] = True
                ancestor = tree.parents[ancestor]
        return attend.to(device)[None, None]
