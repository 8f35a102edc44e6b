"""Per-request speculation statistics, with the conventions of Spec-Bench and EAGLE.

τ (tau) = tokens committed per target forward during decoding, bonus included: vanilla
decoding has τ = 1.00. Acceptance at depth d = of the steps whose tree reached depth d, the
fraction whose accepted path reached it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepRecord:
    accepted: int
    """Drafted tokens accepted this step (0 .. tree depth)."""
    tree_size: int
    """Tree nodes verified, root included."""
    tree_depth: int


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def target_forwards(self) -> int:
        return len(self.steps)

    @property
    def tau(self) -> float:
        """Mean tokens committed per decode-step target forward (accepted + bonus)."""
        if not self.steps:
            return 0.0
        return sum(s.accepted + 1 for s in self.steps) / len(self.steps)

    @property
    def accepted_lengths(self) -> list[int]:
        return [s.accepted for s in self.steps]

    def acceptance_by_depth(self) -> list[float]:
        """Index d-1 holds the acceptance rate at depth d."""
        deepest = max((s.tree_depth for s in self.steps), default=0)
        rates = []
        for depth in range(1, deepest + 1):
            reached = [s for s in self.steps if s.tree_depth >= depth]
            rates.append(sum(s.accepted >= depth for s in reached) / len(reached))
        return rates

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by decode steps (the first token comes from prefill)."""
        return max(self.new_tokens - 1, 0)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "tau": round(self.tau, 4),
            "acceptance_by_depth": [round(r, 4) for r in self.acceptance_by_depth()],
            "accepted_lengths": self.accepted_lengths,
            "mean_tree_size": round(
                sum(s.tree_size for s in self.steps) / max(len(self.steps), 1), 2
            ),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
        }
