"""Draft heads: Medusa, EAGLE and EAGLE-3, their config, and their checkpoints."""

from selfspec.heads.checkpoint import HeadsCheckpointError, load_heads, save_heads
from selfspec.heads.config import HeadKind, HeadsConfig
from selfspec.heads.eagle import EagleCache, EagleHead
from selfspec.heads.eagle3 import Eagle3Head
from selfspec.heads.factory import build_heads, heads_config_for
from selfspec.heads.medusa import MedusaHeads

__all__ = [
    "Eagle3Head",
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
