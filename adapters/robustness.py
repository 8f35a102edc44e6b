"""How much speculation each adapter keeps: τ, acceptance per depth, speedup, losslessness.

The heads were trained on the base; every adapter shifts the target's distribution away from what
they learnt. For the base and each adapter, on the same prompts, this runs vanilla and speculative
greedy decoding side by side (alternating per prompt, so load on the machine hits both alike) and
reports:

- τ (tokens per target forward, bonus included; vanilla = 1.00) and acceptance per tree depth,
  pooled over every decode step of every prompt;
- decode tokens/s of both modes and their ratio (speedup);
- greedy equality of the two outputs, prompt by prompt (lossless means equal);
- `tau_ratio` = τ_adapter / τ_base, which the `--min-ratio` gate checks;
- agreement with the base: on the adapter's own greedy outputs, the fraction of positions where
  the base's most likely next token is the adapter's (one teacher-forced base forward per
  prompt): how far the adapter moved the distribution the heads were trained on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from selfspec.drafting.context import ContextDrafts
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.reports import machine_record
from selfspec.stats import GenerationStats
from selfspec.tree import TreeSpec

BASE = "(base)"
"""Row name of the base model (no adapter); never an adapter name (see `validate.NAME_PATTERN`)."""


@dataclass(frozen=True)
class EvalSettings:
    """What every row is measured with."""

    max_new_tokens: int = 64
    tree: TreeSpec | None = None
    """None: the heads' default tree."""
    context_drafts: ContextDrafts | None = ContextDrafts()
    """Chains copied from the context into each tree, as `GenerationConfig` takes them (None:
    the heads' drafts alone)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Measurement:
    """One row: the base or one adapter, over all prompts."""

    name: str
    """`BASE` or the adapter name."""
    heads: str
    """"base" (the shared heads) or "own" (heads recalibrated for this adapter)."""
    prompts: int
    new_tokens: int
    """Speculative decode tokens, summed over prompts."""
    tau: float
    """Tokens committed per target forward (accepted + bonus), pooled over every step."""
    acceptance_by_depth: tuple[float, ...]
    """Index d-1: of the steps whose tree reached depth d, the fraction accepted to depth d."""
    speculative_tps: float
    """Decode tokens/s with speculation."""
    vanilla_tps: float
    """Decode tokens/s of vanilla greedy decoding, measured alternately with the above."""
    greedy_equal: int
    """Prompts whose speculative output equals the vanilla output token for token."""
    mismatched_prompts: tuple[int, ...] = ()
    """Indices of prompts whose outputs differ (lossless: empty)."""
    tau_ratio: float = 1.0
    """τ / τ of the base row."""
    agreement_with_base: float | None = None
    """Top-1 agreement of the base with this row's greedy outputs (1.0 for the base row)."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    """What the adapter records about itself (e.g. its recipe metrics)."""

    @property
    def speedup(self) -> float:
        return self.speculative_tps / self.vanilla_tps if self.vanilla_tps > 0 else 0.0

    @property
    def lossless(self) -> bool:
        return self.greedy_equal == self.prompts

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["acceptance_by_depth"] = [round(r, 4) for r in self.acceptance_by_depth]
        data["mismatched_prompts"] = list(self.mismatched_prompts)
        data["meta"] = dict(self.meta)
        for key in ("tau", "speculative_tps", "vanilla_tps", "tau_ratio"):
            data[key] = round(data[key], 4)
        if self.agreement_with_base is not None:
            data["agreement_with_base"] = round(self.agreement_with_base, 4)
        data["speedup"] = round(self.speedup, 4)
        data["lossless"] = self.lossless
        return data


@dataclass(frozen=True)
class RobustnessReport:
    rows: tuple[Measurement, ...]
    """The base first, then each adapter."""
    settings: Mapping[str, Any]
    """Target, heads, dtype, threads, prompts file, tree, machine: how it was measured."""

    def below(self, min_ratio: float) -> list[Measurement]:
        """Adapters whose τ ratio to the base is under `min_ratio`, each judged with the heads it
        is served with: its own when it carries some, else the shared ones."""
        with_own = {row.name for row in self.rows[1:] if row.heads == "own"}
        served = [r for r in self.rows[1:] if r.heads == "own" or r.name not in with_own]
        return [row for row in served if row.tau_ratio < min_ratio]

    def mismatched(self) -> list[Measurement]:
        return [row for row in self.rows if not row.lossless]

    def to_dict(self) -> dict[str, Any]:
        return {"settings": dict(self.settings), "rows": [row.to_dict() for row in self.rows]}

    def to_markdown(self) -> str:
        depth = max((len(r.acceptance_by_depth) for r in self.rows), default=0)
        shown = min(depth, 4)
        header = (
            "| target | heads | agreement with base | τ | τ / τ base | "
            + "".join(f"acc@{d + 1} | " for d in range(shown))
            + "tok/s vanilla | tok/s speculative | speedup | greedy equal |"
        )
        lines = [header, "|" + "---|" * (header.count("|") - 1)]
        for row in self.rows:
            agreement = row.agreement_with_base
            if agreement is None:  # what the adapter recorded about itself
                agreement = row.meta.get("metrics", {}).get("top1_agreement_with_base")
            rates = [*row.acceptance_by_depth[:shown]]
            rates += [None] * (shown - len(rates))
            lines.append(
                f"| {row.name} | {row.heads} | "
                f"{'-' if agreement is None else f'{agreement:.1%}'} | {row.tau:.2f} | "
                f"{row.tau_ratio:.2f} | "
                + "".join("- | " if r is None else f"{r:.2f} | " for r in rates)
                + f"{row.vanilla_tps:.1f} | {row.speculative_tps:.1f} | {row.speedup:.2f}x | "
                f"{row.greedy_equal}/{row.prompts} |"
            )
        settings = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return "\n".join(lines) + f"\n\nMeasured with {settings}.\n"


def measure(
    generator: SpeculativeGenerator,
    prompts: Sequence[Sequence[int]],
    settings: EvalSettings,
    scope: Any = None,
    name: str = BASE,
    heads: str = "base",
    meta: Mapping[str, Any] | None = None,
    progress: Any = None,
    base_scope: Any = None,
) -> Measurement:
    """One row: vanilla and speculative greedy decoding of every prompt, alternating.
    progress: a tqdm bar (or anything with ``update()``) advanced once per prompt.
    base_scope: the base model's step scope, to measure this row's agreement with it (None:
    this row is the base, agreement 1.0)."""
    speculative_cfg = GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        tree=settings.tree,
        context_drafts=settings.context_drafts,
    )
    vanilla_cfg = GenerationConfig(max_new_tokens=settings.max_new_tokens, speculate=False)
    pooled = GenerationStats()
    vanilla_tokens = vanilla_seconds = speculative_tokens = speculative_seconds = 0.0
    mismatched = []
    agreeing = scored = 0
    for index, prompt in enumerate(prompts):
        vanilla = generator.generate(prompt, vanilla_cfg, scope=scope)
        if base_scope is not None:
            hits = base_agreement(generator, prompt, vanilla.token_ids, base_scope)
            agreeing, scored = agreeing + hits, scored + len(vanilla.token_ids)
        speculative = generator.generate(prompt, speculative_cfg, scope=scope)
        if vanilla.token_ids != speculative.token_ids:
            mismatched.append(index)
        pooled.steps.extend(speculative.stats.steps)
        vanilla_tokens += vanilla.stats.decode_tokens
        vanilla_seconds += vanilla.stats.decode_seconds
        speculative_tokens += speculative.stats.decode_tokens
        speculative_seconds += speculative.stats.decode_seconds
        if progress is not None:
            progress.update()
    return Measurement(
        name=name,
        heads=heads,
        prompts=len(prompts),
        new_tokens=int(speculative_tokens),
        tau=pooled.tau,
        acceptance_by_depth=tuple(pooled.acceptance_by_depth()),
        speculative_tps=speculative_tokens / speculative_seconds if speculative_seconds else 0.0,
        vanilla_tps=vanilla_tokens / vanilla_seconds if vanilla_seconds else 0.0,
        greedy_equal=len(prompts) - len(mismatched),
        mismatched_prompts=tuple(mismatched),
        meta=dict(meta or {}),
        agreement_with_base=(agreeing / scored if scored else None) if base_scope else 1.0,
    )


def base_agreement(
    generator: SpeculativeGenerator, prompt: Sequence[int], output: Sequence[int], base_scope: Any
) -> int:
    """How many tokens of ``output`` (generated after ``prompt``) are the base's greedy choice
    at their position, from one teacher-forced forward of the base."""
    if not output:
        return 0
    ids = torch.tensor([[*prompt, *output]], device=generator.target.device)
    with torch.inference_mode(), base_scope():
        logits = generator.target.model(ids).logits[0]  # [L, vocab]
    start = len(prompt) - 1
    chosen = logits[start : start + len(output)].argmax(-1)  # [len(output)]
    return int((chosen == torch.tensor(output, device=chosen.device)).sum())


def with_ratios(rows: Sequence[Measurement]) -> tuple[Measurement, ...]:
    """Rows with `tau_ratio` filled in against the first (base) row."""
    from dataclasses import replace

    base_tau = rows[0].tau if rows else 0.0
    return tuple(replace(r, tau_ratio=r.tau / base_tau if base_tau else 0.0) for r in rows)


def machine() -> dict[str, Any]:
    """Where the numbers come from, and when."""
    return {
        **machine_record(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
