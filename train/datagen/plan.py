"""The plan of a data-engine run: every conversation decided up front from one seed.

Conversation i draws its category (by share), opener, topic / passage / language pair, how its
response is decoded (greedy, or sampled at one of ``temperatures``) and whether it gets a
follow-up turn, from ``random.Random(f"{seed}:{i}")`` alone. Plans of different sizes agree on
their common conversations, so a run can grow (``conversations`` raised) and keep every shard
it already has.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from selfspec.train.datagen.categories import CATEGORIES, FOLLOW_UPS, LANGUAGE_PAIRS, Category


@dataclass(frozen=True)
class PlanConfig:
    conversations: int = 12_000
    seed: int = 0
    greedy_share: float = 0.4
    """Fraction of responses decoded greedily; the rest are sampled."""
    temperatures: tuple[float, ...] = (0.6, 0.8, 1.0)
    top_p: float = 0.95
    follow_up_share: float = 0.2
    """Fraction of conversations that get a second user turn and a second response."""
    categories: tuple[str, ...] = ()
    """Only these categories (empty: all)."""

    def __post_init__(self) -> None:
        if self.conversations < 1:
            raise ValueError(f"plan conversations must be >= 1, got {self.conversations}")
        if not 0 <= self.greedy_share <= 1 or not 0 <= self.follow_up_share <= 1:
            raise ValueError("plan greedy_share and follow_up_share must be in [0, 1]")
        if not self.temperatures or any(t <= 0 for t in self.temperatures):
            raise ValueError(f"plan temperatures must be > 0, got {self.temperatures}")
        known = {c.name for c in CATEGORIES}
        unknown = [c for c in self.categories if c not in known]
        if unknown:
            raise ValueError(f"unknown categories {unknown}; known: {sorted(known)}")


@dataclass(frozen=True)
class Conversation:
    index: int
    category: str
    opener: str
    """The first words of the user message, placeholders filled; the target continues it."""
    temperature: float
    """0.0: greedy response."""
    follow_up: str | None
    """The opener of the second user turn, or None for a single-turn conversation."""


def plan(config: PlanConfig, passages: list[str]) -> list[Conversation]:
    chosen = [c for c in CATEGORIES if not config.categories or c.name in config.categories]
    if any(c.passage for c in chosen) and not passages:
        raise ValueError("the plan has passage categories but no passages were found")
    weights = [c.share for c in chosen]
    return [
        _conversation(config, i, chosen, weights, passages) for i in range(config.conversations)
    ]


def _conversation(
    config: PlanConfig, index: int, chosen: list[Category], weights: list[float], passages
) -> Conversation:
    rng = random.Random(f"{config.seed}:{index}")
    category = rng.choices(chosen, weights)[0]
    source, target = rng.choice(LANGUAGE_PAIRS)
    opener = rng.choice(category.openers).format(
        topic=rng.choice(category.topics),
        passage=rng.choice(passages) if category.passage else "",
        source=source,
        target=target,
    )
    greedy = rng.random() < config.greedy_share
    temperature = 0.0 if greedy else rng.choice(config.temperatures)
    follow_up = rng.choice(FOLLOW_UPS) if rng.random() < config.follow_up_share else None
    return Conversation(index, category.name, opener, temperature, follow_up)
