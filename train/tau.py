"""τ of trained heads, measured with the engine itself on held-out prompts (greedy).

τ = tokens committed per target forward, bonus included (vanilla decoding: 1.00), averaged over
all decode steps of all prompts (not per prompt first), with per-depth acceptance beside it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from tqdm import tqdm

from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import HeadKind
from selfspec.target import apply_chat_template
from selfspec.tree import DEFAULT_STATIC_TREE, TreeSpec


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
        steps, new_tokens, seconds = [], 0, 0.0
        config = GenerationConfig(max_new_tokens=max_new_tokens, tree=tree)
        started = time.perf_counter()
        for ids in tqdm(prompt_ids, desc=f"tau {name}", unit="prompt"):
            stats = generator.generate(ids, config).stats
            steps.extend(stats.steps)
            new_tokens += stats.decode_tokens
            seconds += stats.decode_seconds
        depth = max((s.tree_depth for s in steps), default=0)
        acceptance = [
            sum(s.accepted >= d for s in steps if s.tree_depth >= d)
            / max(sum(s.tree_depth >= d for s in steps), 1)
            for d in range(1, depth + 1)
        ]
        results[name] = {
            "tau": round(sum(s.accepted + 1 for s in steps) / max(len(steps), 1), 4),
            "acceptance_by_depth": [round(a, 4) for a in acceptance],
            "prompts": len(prompt_ids),
            "max_new_tokens": max_new_tokens,
            "target_forwards": len(steps),
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
