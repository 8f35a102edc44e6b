"""Medusa drafting: one head call per step gives a distribution for every depth."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.drafting.base import AdvanceRequest, DraftRequest
from selfspec.drafting.grow import DraftPlan, GrowingTree, grow_tree
from selfspec.drafting.projection import DraftProjection
from selfspec.heads.draft_vocab import draft_vocab_of
from selfspec.heads.medusa import MedusaHeads
from selfspec.target_forward import TargetForward
from selfspec.tree import StaticTree, Tree


@dataclass
class MedusaState:
    feature: torch.Tensor  # [H] target feature of the last accepted node


class MedusaDrafter:
    def __init__(self, heads: MedusaHeads, target: TargetForward) -> None:
        self.heads = heads
        self.target = target
        self.projection = DraftProjection(target.lm_head, draft_vocab_of(heads), heads)

    def start(
        self, prompt_features: torch.Tensor, prompt_tokens: torch.Tensor, first_token: int
    ) -> MedusaState:
        return MedusaState(feature=prompt_features[-1])

    def draft(
        self,
        state: MedusaState,
        root_token: int,
        plan: DraftPlan,
        generator: torch.Generator | None,
    ) -> Tree:
        num_heads = self.heads.config.num_heads
        depth = plan.tree.depth
        if depth > num_heads:
            kind = "static" if isinstance(plan.tree, StaticTree) else "dynamic"
            raise ValueError(f"{kind} tree depth {depth} exceeds the {num_heads} Medusa heads")
        # Head k predicts the children of nodes at depth k (the root's children: head 0).
        head_logits = self.projection.logits(self.heads(state.feature))  # [K, N]

        def expand(tree: GrowingTree, frontier: list[int]) -> torch.Tensor:
            depths = torch.tensor([tree.depths[n] for n in frontier], device=head_logits.device)
            return head_logits[depths]  # [F, N]

        return grow_tree(root_token, expand, plan, generator, self.projection)

    def draft_many(self, requests: Sequence[DraftRequest]) -> list[Tree]:
        """One by one: a Medusa draft is one heads call per request already."""
        return [self.draft(r.state, r.root_token, r.plan, r.generator) for r in requests]

    def advance(
        self,
        state: MedusaState,
        accepted_features: torch.Tensor,
        accepted_tokens: torch.Tensor,
        bonus: int,
    ) -> None:
        state.feature = accepted_features[-1]

    def advance_many(self, requests: Sequence[AdvanceRequest]) -> None:
        for r in requests:
            self.advance(r.state, r.accepted_features, r.accepted_tokens, r.bonus)
