"""τ of trained heads, measured with the engine itself on held-out prompts (greedy).

τ = tokens committed per target forward, bonus included (vanilla decoding: 1.00), averaged over
all decode steps of all prompts (not per prompt first), with per-depth acceptance beside it.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
from tqdm import tqdm

from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import HeadKind
from selfspec.stats import StepRecord
from selfspec.target import apply_chat_template
from selfspec.tree import DEFAULT_STATIC_TREE, TreeSpec


def decode_steps(
    generator: SpeculativeGenerator,
    prompt_ids: list[list[int]],
    config: GenerationConfig,
    desc: str,
    seeds: list[int] | None = None,
) -> tuple[list[StepRecord], int, float]:
    """Decode every prompt with ``config``; (every step's record, decode tokens, decode seconds).

    ``seeds`` (one per prompt) replaces the config's seed prompt by prompt, so sampled runs
    repeat exactly whatever else is measured beside them.
    """
    steps: list[StepRecord] = []
    new_tokens, seconds = 0, 0.0
    for index, ids in enumerate(tqdm(prompt_ids, desc=desc, unit="prompt")):
        request = config if seeds is None else replace(config, seed=seeds[index])
        stats = generator.generate(ids, request).stats
        steps.extend(stats.steps)
        new_tokens += stats.decode_tokens
        seconds += stats.decode_seconds
    return steps, new_tokens, seconds


def pooled_tau(steps: list[StepRecord]) -> dict[str, Any]:
    """τ and acceptance per depth pooled over ``steps`` (not averaged per prompt first).

    {"tau", "acceptance_by_depth" (index d-1: depth d), "target_forwards"}; τ is 0.0 without
    steps.
    """
    depth = max((s.tree_depth for s in steps), default=0)
    acceptance = [
        sum(s.accepted >= d for s in steps if s.tree_depth >= d)
        / max(sum(s.tree_depth >= d for s in steps), 1)
        for d in range(1, depth + 1)
    ]
    return {
        "tau": round(sum(s.accepted + 1 for s in steps) / max(len(steps), 1), 4),
        "acceptance_by_depth": [round(a, 4) for a in acceptance],
        "target_forwards": len(steps),
    }


def measure_tau(
    model: Any,
    heads: torch.nn.Module,
    tokenizer: Any,
    prompts: list[Any],
    trees: dict[str, TreeSpec | None],
    max_new_tokens: int,
) -> dict[str, dict[str, Any]]:
    """{tree name: {"tau", "acceptance_by_depth", "prompts", "new_tokens", "decode_tokens_per_s"}}.

    A tree of None means the generator's default (the dynamic tree for the heads' kind).
    """
    generator = SpeculativeGenerator(model, heads, tokenizer)
    prompt_ids = [apply_chat_template(tokenizer, p) for p in prompts]
    results = {}
    for name, tree in trees.items():
        config = GenerationConfig(max_new_tokens=max_new_tokens, tree=tree)
        started = time.perf_counter()
        steps, new_tokens, seconds = decode_steps(generator, prompt_ids, config, f"tau {name}")
        pooled = pooled_tau(steps)
        results[name] = {
            "tau": pooled["tau"],
            "acceptance_by_depth": pooled["acceptance_by_depth"],
            "prompts": len(prompt_ids),
            "max_new_tokens": max_new_tokens,
            "target_forwards": pooled["target_forwards"],
            "decode_tokens_per_s": round(new_tokens / seconds, 2) if seconds else 0.0,
            "wall_seconds": round(time.perf_counter() - started, 1),
        }
    return results


def default_trees(heads: torch.nn.Module) -> dict[str, TreeSpec | None]:
    """The engine's default dynamic tree, and DEFAULT_STATIC_TREE where the heads reach its depth
    (Medusa drafts no deeper than its number of heads)."""
    trees: dict[str, TreeSpec | None] = {"dynamic": None}
    config = heads.config
    if config.kind is not HeadKind.MEDUSA or config.num_heads >= DEFAULT_STATIC_TREE.depth:
        trees["static"] = DEFAULT_STATIC_TREE
    return trees
