"""Where a decoding step's time goes: torch.profiler over real generations, per step phase.

The decoding loop labels its phases with ``record_function`` ("selfspec.draft",
"selfspec.verify_forward", "selfspec.verify_lm_head", ...); this script profiles a few held-out
prompts and reports each phase's milliseconds per step and share of the step.

    .venv/bin/python benchmarks/profile_step.py --dtype float32 --heads eagle --tree auto
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from selfspec.atomic import write_text_atomic
from selfspec.cost_curve import machine_cost_curve, needs_cost_curve
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import load_heads
from selfspec.shipped import resolve_heads_dir
from selfspec.target import TargetSpec, apply_chat_template, load_target
from selfspec.tree import parse_tree_spec

HELDOUT = Path(__file__).resolve().parents[1] / "train" / "data" / "prompts_heldout.jsonl"
PREFIX = "selfspec."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=HELDOUT)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--heads", default="eagle", help="'eagle', 'medusa', a dir, or 'none'")
    parser.add_argument("--tree", default="auto")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = parser.parse_args()

    target = load_target(TargetSpec(dtype=args.dtype, threads=args.threads))
    heads = (
        None
        if args.heads == "none"
        else load_heads(resolve_heads_dir(args.heads, True), target.model)
    )
    tree = parse_tree_spec(args.tree)
    curve = machine_cost_curve(target.model) if heads and needs_cost_curve(tree) else None
    generator = SpeculativeGenerator(target.model, heads, target.tokenizer, curve)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, speculate=heads is not None, tree=tree
    )
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [apply_chat_template(target.tokenizer, r["prompt"]) for r in rows[: args.num_prompts]]
    generator.generate(prompts[0], config)  # warm-up

    steps = tokens = 0
    taus = []
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ids in tqdm(prompts, desc="profile", unit="prompt"):
            result = generator.generate(ids, config)
            steps += result.stats.target_forwards
            tokens += result.stats.new_tokens
            taus.append(result.stats.tau)
        wall = time.perf_counter() - started  # before the profiler's own teardown
    phases = {
        e.key[len(PREFIX) :]: e.cpu_time_total / 1000 / steps  # ms per step
        for e in prof.key_averages()
        if e.key.startswith(PREFIX)
    }
    step_ms = wall * 1000 / steps
    phases["other (loop, stats, stops)"] = max(step_ms - sum(phases.values()), 0.0)
    print(
        f"{args.dtype}, heads={args.heads}, tree={args.tree}, threads={torch.get_num_threads()}:"
        f" {steps} steps, {tokens} tokens, tau {sum(taus) / len(taus):.2f}, "
        f"{step_ms:.1f} ms/step (profiled), {tokens / wall:.1f} tok/s\n"
    )
    print("| phase | ms / step | share |\n|---|---:|---:|")
    for name, ms in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {ms:.1f} | {ms / step_ms:.0%} |")
    if args.out:
        report = {"step_ms": step_ms, "phases_ms": phases}
        write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
