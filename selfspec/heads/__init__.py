"""Draft heads: Medusa and EAGLE, their config, and their checkpoints."""

from selfspec.heads.checkpoint import HeadsCheckpointError, load_heads, save_heads
from selfspec.heads.config import HeadKind, HeadsConfig
from selfspec.heads.eagle import EagleCache, EagleHead
from selfspec.heads.factory import build_heads, heads_config_for
from selfspec.heads.medusa import MedusaHeads

__all__ = [
    "EagleCache",
    "EagleHead",
    "HeadKind",
    "HeadsCheckpointError",
    "HeadsConfig",
    "MedusaHeads",
    "build_heads",
    "heads_config_for",
    "load_heads",
    "save_heads",
]
