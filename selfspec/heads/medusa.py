"""Medusa heads: K stacks of residual SiLU blocks on the target's last feature.

Head k maps the feature at position t to a feature whose logits (through the target's own
lm_head, passed in, never copied) predict token t+k+2; the target itself predicts t+1. Blocks
are zero-initialised, so an untrained head is the identity and predicts what the target does.
"""

from __future__ import annotations

import torch
from torch import nn

from selfspec.heads.config import HeadKind, HeadsConfig
from selfspec.heads.draft_vocab import register_draft_vocab
from selfspec.heads.registry import register_heads


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


@register_heads(HeadKind.MEDUSA)
class MedusaHeads(nn.Module):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        if config.kind is not HeadKind.MEDUSA:
            raise ValueError(f"MedusaHeads needs kind=medusa, got {config.kind.value}")
        self.config = config
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads)
        )
        register_draft_vocab(self, config)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """# [..., H] -> [..., K, H]: head k's feature, to be projected by the target's lm_head."""
        return torch.stack([head(features) for head in self.heads], dim=-2)
