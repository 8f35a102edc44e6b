"""Decoding speed when sampling (temperature > 0): plain decoding, speculation whose trees hold
the heads' top-k drafts, and speculation whose trees hold draws sampled from the heads, side by
side in one process on the embedded default model.

    .venv/bin/python benchmarks/sampled_speed.py --per-category 2 --threads 1 --out runs/sampled

Every method runs on every prompt, prompt-major (prompt 1 through all methods, then prompt 2 ...),
so background noise spreads over all of them alike. Each run decodes exactly
``--max-new-tokens`` (EOS ignored: sampled outputs end at different places, and the rates should
compare equal amounts of work) with the prompt's own seed. All methods are lossless: their outputs
have the target's distribution (``tests/test_rejection_sampling.py``,
``tests/test_sampling_end_to_end.py``), not the same tokens, so no equality is checked here.
Reported per method: output tokens/s (whole generate calls, prefill included), speed-up over
plain decoding, τ and tree tokens per verification forward. Prompts: the first
``--per-category`` of each category of the held-out benchmark set.

Writes OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from selfspec.cost_curve import cached_cost_curve
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import load_heads
from selfspec.reports import machine_record, write_report
from selfspec.sampling import SamplingParams
from selfspec.shipped import resolve_corpus, resolve_heads_dir
from selfspec.target import TargetSpec, apply_chat_template, cache_root, load_target
from selfspec.target_forward import TargetForward
from selfspec.tree import DraftSampling, TreeSpec, parse_tree_spec

HELDOUT = Path(__file__).resolve().parent / "heldout" / "prompts.jsonl"
SAMPLINGS = (DraftSampling.TOP_K, DraftSampling.WITHOUT_REPLACEMENT)


@dataclass
class Method:
    name: str
    generator: SpeculativeGenerator
    speculate: bool
    tree: TreeSpec | None = None
    draft_sampling: DraftSampling = DraftSampling.WITHOUT_REPLACEMENT
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    tree_sizes: list[float] = field(default_factory=list)

    def config(self, params: SamplingParams, max_new: int, seed: int) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=max_new,
            sampling=params,
            seed=seed,
            stop_token_ids=(),
            speculate=self.speculate,
            tree=self.tree,
            draft_sampling=self.draft_sampling,
        )

    def run(self, prompt: list[int], params: SamplingParams, max_new: int, seed: int) -> None:
        started = time.perf_counter()
        result = self.generator.generate(prompt, self.config(params, max_new, seed))
        self.seconds.append(time.perf_counter() - started)
        self.tokens.append(len(result.token_ids))
        self.taus.append(result.stats.tau)
        steps = result.stats.steps
        self.tree_sizes.append(statistics.mean(s.tree_size for s in steps) if steps else 1.0)


def read_prompts(path: Path, per_category: int) -> list[tuple[str, str]]:
    """(id, prompt) of the first ``per_category`` prompts of each category, in file order."""
    taken: dict[str, int] = {}
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        category = row["category"]
        if taken.get(category, 0) < per_category:
            taken[category] = taken.get(category, 0) + 1
            out.append((row["id"], row["prompt"]))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def prompt_seed(seed: int, prompt_id: str) -> int:
    """A prompt's sampling seed: fixed by its id, the same for every method."""
    return zlib.crc32(f"{seed}:{prompt_id}".encode())


def summarise(methods: Sequence[Method]) -> list[dict[str, Any]]:
    """One row per method; ``vs_plain``: its tokens/s over the first method's (plain)."""

    def rate(m: Method) -> float:
        return sum(m.tokens) / sum(m.seconds)

    base = rate(methods[0])
    return [
        {
            "method": m.name,
            "tokens_per_s": round(rate(m), 2),
            "vs_plain": round(rate(m) / base, 3),
            "tau": round(statistics.mean(m.taus), 3),
            "tree_tokens": round(statistics.mean(m.tree_sizes), 2),
            "runs": len(m.seconds),
        }
        for m in methods
    ]


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        f"T={s['temperature']} top-p {s['top_p']}, {s['prompts']} prompts x "
        f"{s['max_new_tokens']} tokens, {report['machine']['threads']} threads, "
        f"{report['machine']['cpu']} ({' '.join(report['machine']['flags'])})",
        "",
        "| method | tok/s | x plain | τ | tree tokens |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['method']} | {row['tokens_per_s']:.1f} | {row['vs_plain']:.2f} | "
            f"{row['tau']:.2f} | {row['tree_tokens']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=HELDOUT, help="held-out JSONL")
    parser.add_argument("--per-category", type=int, default=2, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--heads", default="eagle", help="'eagle', 'medusa' or a heads dir")
    parser.add_argument(
        "--trees",
        nargs="+",
        default=["adaptive=auto"],
        help="NAME=TREE_SPEC pairs (see `selfspec generate --tree`; auto: the default)",
    )
    parser.add_argument("--dtype", default="float32", help="target mode")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--seed", type=int, default=0, help="base of the per-prompt seeds")
    parser.add_argument("--out", type=Path, default=Path("runs/sampled_speed"))
    args = parser.parse_args(argv)
    if args.temperature <= 0:
        parser.error(
            f"--temperature must be > 0 (greedy: benchmarks/speed.py), got {args.temperature}"
        )
    if args.per_category < 1:
        parser.error(f"--per-category must be >= 1, got {args.per_category}")
    return args


def build_methods(args: argparse.Namespace) -> list[Method]:
    """Plain decoding, then each tree with each way of drafting its children."""
    target = load_target(TargetSpec(dtype=args.dtype, threads=args.threads))
    curve = cached_cost_curve(TargetForward(target.model), cache_root())
    heads = load_heads(resolve_heads_dir(args.heads, True), target.model)
    plain = SpeculativeGenerator(target.model, None, target.tokenizer)
    speculative = SpeculativeGenerator(target.model, heads, target.tokenizer, curve)
    speculative.corpus = resolve_corpus("auto", True, target.model)
    methods = [Method("plain decoding", plain, speculate=False)]
    for pair in args.trees:
        name, _, text = pair.partition("=")
        tree = parse_tree_spec(text)
        for sampling in SAMPLINGS:
            label = f"{args.heads} {name}, {sampling.value} drafts"
            methods.append(Method(label, speculative, True, tree, sampling))
    return methods


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = read_prompts(args.prompts, args.per_category)
    methods = build_methods(args)
    tokenizer = methods[0].generator.tokenizer
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    ids = [(pid, apply_chat_template(tokenizer, text)) for pid, text in prompts]
    for method in methods:  # warm-up, not recorded
        method.generator.generate(ids[0][1], method.config(params, 8, 0))
    with tqdm(total=len(ids) * len(methods), desc="sampled speed", unit="run") as bar:
        for pid, prompt in ids:
            for method in methods:
                method.run(prompt, params, args.max_new_tokens, prompt_seed(args.seed, pid))
                bar.update()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_record(),
        "settings": {
            "prompts": len(ids),
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "heads": args.heads,
            "trees": args.trees,
            "dtype": args.dtype,
            "seed": args.seed,
        },
        "rows": summarise(methods),
    }
    write_report(args.out, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
