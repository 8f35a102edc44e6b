"""What the decoding loop needs from a draft: start on a prompt, draft a tree, advance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from selfspec.drafting.grow import DraftPlan
from selfspec.tree import Tree


@dataclass(frozen=True)
class DraftRequest:
    """One request's part of a batched draft (``Drafter.draft_many``)."""

    state: Any  # the drafter's state of the request
    root_token: int
    plan: DraftPlan
    generator: torch.Generator | None


@dataclass(frozen=True)
class AdvanceRequest:
    """One request's accepted path for ``Drafter.advance_many`` (see ``advance``)."""

    state: Any
    accepted_features: torch.Tensor  # [A, F] target features of the accepted path, root first
    accepted_tokens: torch.Tensor  # [A]
    bonus: int


class Drafter(Protocol):
    """Stateless view of a set of heads; all per-request state lives in the returned state.

    "Features" below are the target's last hidden states, unless the drafter has a non-empty
    ``target_layers`` attribute (EAGLE-3): then they are the target's states at those layers
    (HF ``output_hidden_states`` indices), concatenated in that order, # [..., k * H], which the
    decoding loop taps during its forwards (``selfspec.drafting.taps``)."""

    def start(
        self,
        prompt_features: torch.Tensor,  # [S, H] target features of the prompt
        prompt_tokens: torch.Tensor,  # [S]
        first_token: int,  # the token the target produced after the prompt
    ) -> Any: ...

    def draft(
        self, state: Any, root_token: int, plan: DraftPlan, generator: torch.Generator | None
    ) -> Tree: ...

    def draft_many(self, requests: Sequence[DraftRequest]) -> list[Tree]:
        """Each request's tree, as ``draft`` would give it, drafted together where the heads
        can (EAGLE: one head call per depth for all of them)."""
        ...

    def advance(
        self,
        state: Any,
        accepted_features: torch.Tensor,  # [A, H] target features of the accepted path, root first
        accepted_tokens: torch.Tensor,  # [A]
        bonus: int,
    ) -> None: ...

    def advance_many(self, requests: Sequence[AdvanceRequest]) -> None:
        """Each request's ``advance``, together where the heads can (EAGLE: one head call)."""
        ...
