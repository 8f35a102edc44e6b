"""Speculative vs vanilla greedy output on the default model, token for token, in every mode.

    .venv/bin/python benchmarks/exactness.py --num-prompts 20 --max-new-tokens 128 \\
        --dtypes float32 bfloat16 int8 int4 --out runs/exactness

For each mode, each held-out prompt is decoded plainly and with the shipped EAGLE heads (the
adaptive tree and a fixed dynamic tree; context drafts and the shipped draft corpus on, as
`selfspec generate` and `serve` run by default); a row counts the prompts whose speculative
tokens equal the vanilla tokens exactly, and where they differ, the first differing position.
With the row-invariant kernels every mode should give all prompts equal.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.cost_curve import cpu_flags, cpu_model, machine_cost_curve
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import load_heads
from selfspec.kernels.ops import kernel_isa
from selfspec.modes import split_mode
from selfspec.reports import write_report
from selfspec.shipped import resolve_corpus, shipped_heads_dir
from selfspec.target import TargetSpec, apply_chat_template, load_target
from selfspec.tree import parse_tree_spec

HELDOUT = Path(__file__).resolve().parents[1] / "train" / "data" / "prompts_heldout.jsonl"


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8", "int4"])
    parser.add_argument("--trees", nargs="+", default=["adaptive", "dynamic:4,4,8"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/exactness"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    prompts = [row["prompt"] for row in rows[: args.num_prompts]]
    results = []
    for dtype in args.dtypes:
        name, activations = split_mode(dtype)  # float32:float / float32:int24
        target = load_target(TargetSpec(dtype=name, activations=activations))
        heads = load_heads(shipped_heads_dir("eagle"), target.model)
        curve = machine_cost_curve(target.model)
        generator = SpeculativeGenerator(target.model, heads, target.tokenizer, curve)
        generator.corpus = resolve_corpus("auto", True, target.model)  # as generate and serve
        plain = GenerationConfig(max_new_tokens=args.max_new_tokens, speculate=False)
        for tree_text in args.trees:
            tree = parse_tree_spec(tree_text)
            config = GenerationConfig(max_new_tokens=args.max_new_tokens, tree=tree)
            equal, differences, tokens = 0, [], 0
            for prompt in tqdm(prompts, desc=f"{dtype} {tree_text}", unit="prompt"):
                ids = apply_chat_template(target.tokenizer, prompt)
                vanilla = generator.generate(ids, plain).token_ids
                speculative = generator.generate(ids, config).token_ids
                tokens += len(vanilla)
                where = first_difference(vanilla, speculative)
                equal += where is None
                if where is not None:
                    differences.append(where)
            results.append(
                {
                    "dtype": dtype,
                    "tree": tree_text,
                    "equal": f"{equal}/{len(prompts)}",
                    "vanilla_tokens": tokens,
                    "first_differences": differences,
                }
            )
    report = {
        "cpu": cpu_model(),
        "flags": cpu_flags(),
        "kernels": kernel_isa(),
        "date": time.strftime("%Y-%m-%d"),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "rows": results,
    }
    lines = [
        f"Speculative vs vanilla greedy, {len(prompts)} held-out prompts x {args.max_new_tokens} "
        f"tokens; {report['cpu']} ({' '.join(report['flags'])}), kernels {report['kernels']}, "
        f"{report['date']}",
        "",
        "| mode | tree | equal | vanilla tokens | first differing positions |",
        "|---|---|---:|---:|---|",
    ]
    for row in results:
        where = ", ".join(map(str, row["first_differences"])) or "-"
        cells = (row["dtype"], row["tree"], row["equal"], str(row["vanilla_tokens"]), where)
        lines.append("| " + " | ".join(cells) + " |")
    write_report(args.out, report, "\n".join(lines) + "\n", stem="exactness")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
