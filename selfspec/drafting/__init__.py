"""Drafting: grow a tree from heads (Medusa, EAGLE or EAGLE-3)."""

from selfspec.drafting.base import AdvanceRequest, Drafter, DraftRequest
from selfspec.drafting.eagle import EagleDrafter, EagleState
from selfspec.drafting.eagle3 import Eagle3Drafter
from selfspec.drafting.grow import DraftPlan, draw_children, grow_tree
from selfspec.drafting.medusa import MedusaDrafter, MedusaState

__all__ = [
    "AdvanceRequest",
    "DraftPlan",
    "DraftRequest",
    "Drafter",
    "Eagle3Drafter",
    "EagleDrafter",
    "EagleState",
    "MedusaDrafter",
    "MedusaState",
    "draw_children",
    "grow_tree",
    "make_drafter",
]


def make_drafter(heads: object, target: object) -> Drafter:
    """The drafter for a heads module (MedusaHeads, EagleHead or Eagle3Head)."""
    from selfspec.heads.eagle import EagleHead
    from selfspec.heads.eagle3 import Eagle3Head
    from selfspec.heads.medusa import MedusaHeads

    if isinstance(heads, MedusaHeads):
        return MedusaDrafter(heads, target)  # type: ignore[arg-type]
    if isinstance(heads, EagleHead):
        return EagleDrafter(heads, target)  # type: ignore[arg-type]
    if isinstance(heads, Eagle3Head):
        return Eagle3Drafter(heads, target)  # type: ignore[arg-type]
    raise TypeError(f"not a heads module: {type(heads).__name__}")
