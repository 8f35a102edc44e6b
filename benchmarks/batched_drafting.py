"""Drafting B requests in one heads call vs one call per request, side by side (issue #18).

B held-out prompts are prefilled, then for several rounds each request's next tree is drafted
both ways, in alternating order, and each round's trees are checked equal (the fused head is
row-invariant); the trees are then verified (untimed) so the next round drafts from new states.
Prints milliseconds per round of drafting for all B requests, and the ratio.

    .venv/bin/python benchmarks/batched_drafting.py --batch-sizes 1 2 4 8 --tree dynamic:4,4,8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.atomic import write_text_atomic
from selfspec.cost_curve import cpu_flags, cpu_model
from selfspec.generation import GenerationConfig, GenerationStream, SpeculativeGenerator
from selfspec.heads import load_heads
from selfspec.shipped import resolve_heads_dir
from selfspec.target import TargetSpec, apply_chat_template, load_target
from selfspec.tree import parse_tree_spec

HELDOUT = Path(__file__).resolve().parents[1] / "train" / "data" / "prompts_heldout.jsonl"


def _same_trees(a, b) -> bool:
    return all(
        torch.equal(getattr(x.tree, name), getattr(y.tree, name))
        for x, y in zip(a, b, strict=True)
        for name in ("tokens", "parents", "scores")
    )


def measure(generator, prompts, config, batch: int, rounds: int) -> dict[str, float]:
    streams = [generator.stream(p, config) for p in prompts[:batch]]
    for stream in streams:
        stream.start()
    alone_ms, together_ms, equal = [], [], True
    for round_index in range(rounds):
        running = [s for s in streams if not s.done]
        if len(running) < batch:
            break
        order = ("alone", "together") if round_index % 2 == 0 else ("together", "alone")
        steps = {}
        for how in order:
            started = time.perf_counter()
            if how == "alone":
                steps[how] = [stream.draft(batch_size=batch) for stream in running]
            else:
                steps[how] = GenerationStream.draft_together(
                    running, batch, [True] * batch, [False] * batch
                )
            (alone_ms if how == "alone" else together_ms).append(
                (time.perf_counter() - started) * 1000
            )
        equal = equal and _same_trees(steps["alone"], steps["together"])
        for stream, step in zip(running, steps["together"], strict=True):
            stream.verify(step)
    alone, together = statistics.median(alone_ms), statistics.median(together_ms)
    return {
        "batch": batch,
        "rounds": len(alone_ms),
        "alone_ms": round(alone, 2),
        "together_ms": round(together, 2),
        "together_vs_alone": round(together / alone, 3),
        "trees_equal": equal,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=HELDOUT)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", default="eagle", help="'eagle', 'eagle3' or a heads dir")
    parser.add_argument("--tree", default="dynamic:4,4,8")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()

    target = load_target(TargetSpec(dtype=args.dtype, threads=args.threads))
    heads = load_heads(resolve_heads_dir(args.heads, True), target.model)
    generator = SpeculativeGenerator(target.model, heads, target.tokenizer)
    config = GenerationConfig(
        max_new_tokens=4 * args.rounds, tree=parse_tree_spec(args.tree), stop_token_ids=()
    )
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [apply_chat_template(target.tokenizer, r["prompt"]) for r in rows]
    if max(args.batch_sizes) > len(prompts):
        parser.error(f"--batch-sizes up to {len(prompts)} (the prompts file's rows)")
    measure(generator, prompts, config, 2, 2)  # warm-up
    print(f"{cpu_model()}; flags {' '.join(cpu_flags())}; {args.dtype}, {args.threads} thread(s)")
    print(f"heads {args.heads}, tree {args.tree}")
    results = []
    for batch in tqdm(args.batch_sizes, desc="batch sizes"):
        results.append(measure(generator, prompts, config, batch, args.rounds))
    print("| requests | rounds | alone ms | together ms | together / alone | trees equal |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(
            f"| {r['batch']} | {r['rounds']} | {r['alone_ms']} | {r['together_ms']} | "
            f"{r['together_vs_alone']} | {r['trees_equal']} |"
        )
    if args.out is not None:
        record = {"cpu": cpu_model(), "flags": cpu_flags(), "args": vars(args) | {"out": None}}
        write_text_atomic(args.out, json.dumps({**record, "rows": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
