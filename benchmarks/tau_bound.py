"""The most τ a tree of fixed tokens can reach with a given budget when sampling: the target as
its own drafter, on the held-out benchmark prompts.

    .venv/bin/python benchmarks/tau_bound.py --limit 2 --out runs/tau_bound

Why: with lossless sampling the committed tokens are distributed as the target's own samples.
When the tree's tokens are fixed before the target's randomness is drawn (point-mass proposals:
top-k drafts, context chains; EAGLE-2/3's verification), a step commits a drafted node only
when the target's sample follows the node's path. So such a tree's expected τ is

    E[τ] = 1 + Σ_{drafted nodes n} P_target(path to n)

(the target's probabilities at temperature T, multiplied along the path), and no drafter of
fixed tokens, however good, beats the tree that holds the nodes of highest path probability.
Sampled drafts (``DraftSampling.WITHOUT_REPLACEMENT``) are not bound by it: their tokens are
random, and rejection sampling couples them with the target's sample, so a node is accepted
with probability Σ min(p, q) rather than p(token); a drafter equal to the target accepts a
sampled chain to its end (τ = depth + 1). This script finds that
tree at every step, exactly: a best-first search whose candidates are the children of nodes the
target has already scored, each round scoring the newly chosen nodes in one target forward over
the committed cache plus the nodes scored before (tree attention), until the best ``budget``
nodes of depth ≤ ``depth`` are all known. The best tree of a smaller budget is the first nodes
of the same ranking, so one search gives the bound for every budget up to ``budget``.

Decoding follows the target's own sampling exactly (the step's sampled path through the tree,
then the bonus), so the prompts' trajectories are those lossless speculation would produce.
Reported per category, pooled over steps: the expected bound (mean of E[τ] over steps) for each
budget, and the realized τ of the largest tree (committed tokens per step).

Writes OUT/results.json, OUT/results.md and, where matplotlib is installed, OUT/tau_bound.png.
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache

from selfspec.cost_curve import cpu_flags, cpu_model
from selfspec.generation import eos_token_ids
from selfspec.kv_commit import drop_uncommitted
from selfspec.reports import machine_record, write_report
from selfspec.sampling import SamplingParams, sample_from, warp_probs
from selfspec.target import TargetSpec, apply_chat_template, load_target
from selfspec.target_forward import TargetForward

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tau_heldout  # noqa: E402

REPORTED_BUDGETS = (4, 8, 16, 32, 60)


@dataclass
class Node:
    token: int
    parent: int  # index into the search's node list, -1 for the root
    depth: int
    log_prob: float  # log P_target(path from the root to this node), 0 for the root
    slot: int = -1  # cache position past the committed prefix once scored, else -1
    probs: torch.Tensor | None = None  # [vocab] the target's distribution after this node


@dataclass
class BestTree:
    """The search's result: every node it knows, the chosen ones best first."""

    nodes: list[Node]
    chosen: list[int]  # node indices (root excluded), highest path probability first
    forwards: int  # target forwards the search took
    scored: int  # nodes the target scored (root included)

    def expected_tau(self, budget: int) -> float:
        return 1.0 + sum(math.exp(self.nodes[i].log_prob) for i in self.chosen[:budget])


@dataclass
class Trace:
    """One prompt's decode: per step the bound at each budget and what was committed."""

    expected: dict[int, list[float]] = field(default_factory=dict)
    committed: list[int] = field(default_factory=list)  # tokens committed per step
    tokens: list[int] = field(default_factory=list)  # every committed token, in order
    forwards: int = 0
    scored: int = 0


def _children(node: Node, index: int, width: int) -> list[Node]:
    """The ``width`` likeliest children of a scored node, as candidates."""
    assert node.probs is not None
    values, tokens = torch.topk(node.probs, min(width, node.probs.shape[-1]))  # [width] each
    return [
        Node(token=t, parent=index, depth=node.depth + 1, log_prob=node.log_prob + math.log(v))
        for v, t in zip(values.tolist(), tokens.tolist(), strict=True)
        if v > 0.0
    ]


def best_tree(
    target: TargetForward,
    cache: DynamicCache,
    committed_len: int,
    root: int,
    params: SamplingParams,
    budget: int,
    depth: int,
) -> BestTree:
    """The ``budget`` nodes of depth ≤ ``depth`` with the highest target path probability below
    ``root``, each one's distribution known where the walk may need it. Leaves the cache holding
    only the committed prefix."""
    nodes = [Node(token=root, parent=-1, depth=0, log_prob=0.0)]
    pending = [0]  # nodes to score in the next forward
    forwards = 0
    scored = 0
    while pending:
        _score(target, cache, committed_len, nodes, pending, params, scored)
        scored += len(pending)
        forwards += 1
        for index in pending:
            if nodes[index].depth < depth:
                nodes.extend(_children(nodes[index], index, budget))
        chosen = _ranked(nodes, budget)
        pending = [i for i in chosen if nodes[i].slot < 0 and nodes[i].depth < depth]
    drop_uncommitted(cache, committed_len)
    return BestTree(nodes=nodes, chosen=chosen, forwards=forwards, scored=scored)


def _ranked(nodes: Sequence[Node], budget: int) -> list[int]:
    """The best ``budget`` non-root nodes: highest path probability, then shallower, then older
    (a parent always ranks before its children, so the set is a tree)."""
    return heapq.nsmallest(
        budget, range(1, len(nodes)), key=lambda i: (-nodes[i].log_prob, nodes[i].depth, i)
    )


def _score(
    target: TargetForward,
    cache: DynamicCache,
    committed_len: int,
    nodes: list[Node],
    pending: Sequence[int],
    params: SamplingParams,
    scored_before: int,
) -> None:
    """One forward over the pending nodes; each attends to the prefix, its scored ancestors and
    itself. Their entries stay in the cache (slots scored_before...) for later rounds."""
    count = len(pending)
    width = committed_len + scored_before + count
    mask = torch.full((1, 1, count, width), torch.finfo(target.dtype).min, dtype=target.dtype)
    mask[..., :committed_len] = 0.0
    for row, index in enumerate(pending):
        nodes[index].slot = scored_before + row
        ancestor = index
        while ancestor >= 0:
            mask[0, 0, row, committed_len + nodes[ancestor].slot] = 0.0
            ancestor = nodes[ancestor].parent
    tokens = torch.tensor([[nodes[i].token for i in pending]])  # [1, count]
    positions = torch.tensor([[committed_len + nodes[i].depth for i in pending]])  # [1, count]
    with torch.inference_mode():
        features = target.features(tokens, positions, cache, mask)[0]  # [count, H]
        probs = warp_probs(target.logits(features), params)  # [count, vocab]
    for row, index in enumerate(pending):
        nodes[index].probs = probs[row]


def walk(tree: BestTree, generator: torch.Generator) -> tuple[list[int], int | None]:
    """The target's own sample through the tree: the drafted tokens it follows, then the bonus
    (None when the path ends on a node whose distribution was not needed by the search: a leaf
    at the depth limit; the caller draws the bonus after committing)."""
    kids: dict[int, dict[int, int]] = {}
    for index in tree.chosen:
        kids.setdefault(tree.nodes[index].parent, {})[tree.nodes[index].token] = index
    path: list[int] = []
    node = 0
    while True:
        probs = tree.nodes[node].probs
        if probs is None:
            return path, None
        token = int(sample_from(probs, generator))
        child = kids.get(node, {}).get(token)
        if child is None:
            return path, token
        path.append(token)
        node = child


def prefill(target: TargetForward, prompt_ids: list[int]) -> tuple[DynamicCache, int]:
    """A cache of every prompt token but the last (the first step's root), and its length."""
    cache = target.new_cache()
    prefix = torch.tensor([prompt_ids[:-1]])  # [1, S - 1]
    with torch.inference_mode():
        target.features(prefix, torch.arange(prefix.shape[1])[None], cache)
    return cache, prefix.shape[1]


def decode(
    target: TargetForward,
    prompt_ids: list[int],
    params: SamplingParams,
    budget: int,
    depth: int,
    max_new_tokens: int,
    seed: int,
    stop_ids: set[int],
) -> Trace:
    """Sample up to ``max_new_tokens`` from the target, a speculative step at a time, recording
    the best tree's expected τ at every step."""
    generator = torch.Generator().manual_seed(seed)
    cache, committed_len = prefill(target, prompt_ids)
    root = prompt_ids[-1]
    trace = Trace(expected={b: [] for b in REPORTED_BUDGETS if b <= budget})
    produced = 0
    while produced < max_new_tokens:
        tree = best_tree(target, cache, committed_len, root, params, budget, depth)
        for b in trace.expected:
            trace.expected[b].append(tree.expected_tau(b))
        trace.forwards += tree.forwards
        trace.scored += tree.scored
        path, bonus = walk(tree, generator)
        chain = torch.tensor([[root, *path]])  # [1, 1 + A]: into the cache
        positions = torch.arange(committed_len, committed_len + chain.shape[1])[None]
        with torch.inference_mode():
            last = target.features(chain, positions, cache)[0, -1]  # [H]
            if bonus is None:
                bonus = int(sample_from(warp_probs(target.logits(last), params), generator))
        committed_len += chain.shape[1]
        new = [*path, bonus]
        trace.committed.append(len(new))
        trace.tokens.extend(new)
        produced += len(new)
        root = bonus
        if stop_ids & set(new):
            break
    return trace


def summarize(traces: Sequence[Trace]) -> dict[str, Any]:
    """Pooled over every step of the traces."""
    steps = sum(len(t.committed) for t in traces)
    budgets = traces[0].expected.keys()
    return {
        "steps": steps,
        "tokens": sum(sum(t.committed) for t in traces),
        "realized_tau": round(sum(sum(t.committed) for t in traces) / steps, 4),
        "expected_tau": {
            str(b): round(sum(sum(t.expected[b]) for t in traces) / steps, 4) for b in budgets
        },
        "forwards_per_step": round(sum(t.forwards for t in traces) / steps, 2),
        "scored_per_step": round(sum(t.scored for t in traces) / steps, 2),
    }


def markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    budgets = [b for b in REPORTED_BUDGETS if b <= settings["budget"]]
    lines = [
        f"τ bound (the target as its own drafter), depth ≤ {settings['depth']}, "
        f"{settings['max_new_tokens']} new tokens, {settings['dtype']}, "
        f"{settings['prompts']} prompts",
        "",
        "| T | category | prompts | steps | "
        + " | ".join(f"E[τ] best {b} nodes" for b in budgets)
        + f" | realized τ ({settings['budget']}) |",
        "|---:|---|---:|---:|" + "---:|" * len(budgets) + "---:|",
    ]
    for row in report["rows"]:
        for category, result in [*row["categories"].items(), ("**mean**", row["mean"])]:
            cells = [f"{result['expected_tau'][str(b)]:.2f}" for b in budgets]
            lines.append(
                f"| {row['temperature']:g} | {category} | {result.get('prompts', '')} | "
                f"{result.get('steps', '')} | "
                + " | ".join(cells)
                + f" | {result['realized_tau']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """E[τ] of the best tree against its node budget, a line per category (the mean bold), the
    issue's goal at that temperature dashed; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = report["rows"]
    figure, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 4.2), squeeze=False)
    for axis, row in zip(axes[0], rows, strict=True):
        for name, result in [*row["categories"].items(), ("mean", row["mean"])]:
            budgets = [int(b) for b in result["expected_tau"]]
            values = list(result["expected_tau"].values())
            bold = name == "mean"
            axis.plot(budgets, values, marker="o", linewidth=2.5 if bold else 1, label=name)
        goal = tau_heldout.GOALS.get(float(row["temperature"]))
        if goal is not None:
            axis.axhline(goal[0], color="#7f7f7f", linestyle="--", linewidth=0.8)
            axis.annotate(f"goal {goal[0]:g}", (budgets[0], goal[0]), va="bottom", fontsize=7)
        axis.set_xscale("log", base=2)
        axis.set_xticks(budgets, [str(b) for b in budgets])
        axis.set_xlabel(f"tree nodes (best tree of depth ≤ {report['settings']['depth']})")
        axis.set_ylabel("E[τ], the target as its own drafter")
        axis.set_title(f"T={row['temperature']:g}", fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    settings = report["settings"]
    figure.suptitle(
        f"The most τ any drafter reaches: {settings['prompts']} held-out prompts, "
        f"{settings['max_new_tokens']} tokens, {settings['dtype']}",
        fontsize=9,
    )
    return tau_heldout.save_figure(figure, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=tau_heldout.HELDOUT)
    parser.add_argument("--categories", nargs="*", default=None)
    parser.add_argument("--limit", type=int, default=None, help="first N prompts per category")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0])
    parser.add_argument("--budget", type=int, default=tau_heldout.FIXED_TREE.budget)
    parser.add_argument("--depth", type=int, default=tau_heldout.FIXED_TREE.depth)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("runs/tau_bound"))
    args = parser.parse_args(argv)
    if args.budget < 1 or args.depth < 1 or args.max_new_tokens < 1:
        parser.error("--budget, --depth and --max-new-tokens must be >= 1")
    if any(t <= 0 for t in args.temperatures):
        parser.error("--temperatures must be > 0 (at T=0 the bound is depth + 1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        prompts = tau_heldout.select(
            tau_heldout.read_heldout(args.prompts), args.categories, args.limit
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    loaded = load_target(TargetSpec(dtype=args.dtype, threads=args.threads))
    target = TargetForward(loaded.model)
    stop_ids = set(eos_token_ids(loaded.model, loaded.tokenizer))
    print(f"cpu: {cpu_model()}; flags: {' '.join(cpu_flags())}; {torch.get_num_threads()} threads")
    rows = []
    for temperature in args.temperatures:
        params = SamplingParams(temperature=temperature)
        categories = {}
        for category, group in tau_heldout.by_category(prompts).items():
            traces = []
            for prompt in tqdm(group, desc=f"T={temperature:g} {category}"):
                ids = apply_chat_template(loaded.tokenizer, prompt.prompt)
                seed = zlib.crc32(f"{args.seed}:{prompt.id}".encode())
                traces.append(
                    decode(
                        target,
                        ids,
                        params,
                        args.budget,
                        args.depth,
                        args.max_new_tokens,
                        seed,
                        stop_ids,
                    )
                )
            categories[category] = summarize(traces) | {"prompts": len(group)}
        mean = {
            "realized_tau": round(
                sum(c["realized_tau"] for c in categories.values()) / len(categories), 4
            ),
            "expected_tau": {
                b: round(
                    sum(c["expected_tau"][b] for c in categories.values()) / len(categories), 4
                )
                for b in next(iter(categories.values()))["expected_tau"]
            },
        }
        rows.append({"temperature": temperature, "categories": categories, "mean": mean})
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_record(),
        "settings": {
            "prompts": len(prompts),
            "budget": args.budget,
            "depth": args.depth,
            "max_new_tokens": args.max_new_tokens,
            "dtype": args.dtype,
            "seed": args.seed,
            "mean": "unweighted mean of the category values",
        },
        "rows": rows,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    write_report(args.out, report, markdown(report))
    if plot(report, args.out / "tau_bound.png") is None:
        print("(no plot: matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
