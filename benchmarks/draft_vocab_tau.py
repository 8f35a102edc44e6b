"""How much of an adapter's lost acceptance is the shared draft vocabulary? (issue #20, item 1)

For the base and every shipped example adapter, with the shipped EAGLE heads (no recalibrated
heads, no deltas) and a fixed tree: the share of the adapted target's greedy output the shared
draft vocabulary covers, and τ drafting from that vocabulary vs from the whole vocabulary (the
same heads: the projection reads all of the target's lm_head rows instead of the 8192 chosen
from the base's training responses). Held-out prompts, fp32, greedy; outputs checked equal to
vanilla decoding.

    .venv/bin/python benchmarks/draft_vocab_tau.py --out runs/draft_vocab_tau
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.adapters.prompts import default_prompts_file, encode_prompts, read_prompt_file
from selfspec.adapters.robustness import BASE, EvalSettings, measure
from selfspec.adapters.shipped import examples_root
from selfspec.adapters.store import AdapterStore
from selfspec.atomic import write_text_atomic
from selfspec.cost_curve import cpu_flags
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import load_heads
from selfspec.heads.draft_vocab import draft_vocab_of, with_draft_vocab
from selfspec.shipped import resolve_heads_dir
from selfspec.target import TargetSpec, load_target
from selfspec.tree import parse_tree_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree", default="dynamic:4,4,8")
    parser.add_argument("--adapters", nargs="*", default=["code", "docs", "persona", "shout"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/draft_vocab_tau")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(TargetSpec(threads=args.threads))
    store = AdapterStore(target.model, root=examples_root())
    shared = load_heads(resolve_heads_dir("eagle", True), target.model)
    vocab = draft_vocab_of(shared)
    whole = with_draft_vocab(load_heads(resolve_heads_dir("eagle", True), target.model), None)
    generators = {
        "shared vocabulary": SpeculativeGenerator(store.base_model, shared, target.tokenizer),
        "whole vocabulary": SpeculativeGenerator(store.base_model, whole, target.tokenizer),
    }
    prompts = encode_prompts(
        target.tokenizer, read_prompt_file(default_prompts_file(), args.prompts)
    )
    settings = EvalSettings(max_new_tokens=args.max_new_tokens, tree=parse_tree_spec(args.tree))
    in_vocab = torch.zeros(target.model.config.vocab_size, dtype=torch.bool)
    in_vocab[vocab] = True
    rows = []
    for name in tqdm([None, *args.adapters], desc="adapters"):
        scope = store.scope(name)
        plain = GenerationConfig(max_new_tokens=args.max_new_tokens, speculate=False)
        outputs = [generators["shared vocabulary"].generate(p, plain, scope=scope) for p in prompts]
        tokens = torch.tensor([t for out in outputs for t in out.token_ids])
        row = {
            "adapter": name or BASE,
            "coverage": round(float(in_vocab[tokens].float().mean()), 4),
        }
        for label, generator in generators.items():
            measured = measure(generator, prompts, settings, scope=scope, name=name or BASE)
            row[label] = {
                "tau": round(measured.tau, 3),
                "acceptance_by_depth": [round(a, 3) for a in measured.acceptance_by_depth[:3]],
                "greedy_equal": f"{measured.greedy_equal}/{measured.prompts}",
            }
        rows.append(row)
    base = rows[0]
    lines = [
        "| target | shared vocabulary covers | τ shared vocabulary | τ / base | "
        "τ whole vocabulary | τ / base | greedy equal |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        s, w = row["shared vocabulary"], row["whole vocabulary"]
        lines.append(
            f"| {row['adapter']} | {row['coverage']:.1%} | {s['tau']:.2f} | "
            f"{s['tau'] / base['shared vocabulary']['tau']:.2f} | {w['tau']:.2f} | "
            f"{w['tau'] / base['whole vocabulary']['tau']:.2f} | "
            f"{s['greedy_equal']}, {w['greedy_equal']} |"
        )
    settings_line = (
        f"{args.prompts} held-out prompts x {args.max_new_tokens} tokens, tree {args.tree}, "
        f"fp32, {args.threads} thread(s), CPU flags: {' '.join(cpu_flags())}"
    )
    markdown = "\n".join(lines) + f"\n\n{settings_line}\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "draft_vocab_tau.json", json.dumps(rows, indent=2) + "\n")
    write_text_atomic(out / "draft_vocab_tau.md", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
