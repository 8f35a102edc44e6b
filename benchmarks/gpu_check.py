"""GPU check: selfspec on a CUDA GPU beside HF `generate` on the same GPU, speed and exactness.

For each dtype (float32, bfloat16), greedy, batch 1, every method on every prompt, prompt-major
(prompt 1 through all methods, then prompt 2 ...), all on the one GPU:

- HF generate: the model as HF ships it (transformers' own ops);
- selfspec vanilla: selfspec's decoding loop without heads (tau = 1);
- selfspec EAGLE: the shipped EAGLE heads, with the adaptive tree (sized per step from a cost
  curve measured on this GPU) and a fixed dynamic tree.

Reported per method: tokens/s (new tokens over the whole generate call, prefill included, the
clock read after ``torch.cuda.synchronize``), tau, the speedup over HF generate in the same
dtype, and exactness: how many outputs equal selfspec's vanilla greedy token for token, and HF's.
On a GPU the target runs transformers' ops, not the CPU's row-invariant kernels, so a tree's
rows may round differently than the same tokens decoded one by one; every divergence is listed
with vanilla's top-2 logit gap where it happened, to tell a float-noise tie (gap ~1e-5 in
float32, ~1e-2 in bfloat16) from a bug.

    python benchmarks/gpu_check.py --out runs/gpu-check            # on a GPU machine
    python benchmarks/gpu_check.py --device cpu --num-prompts 2 --max-new-tokens 16 --dtypes \
        float32 --out /tmp/gpu-check                                 # the script itself, on a CPU

Writes gpu_check.json and gpu_check.md under --out (scripts/gpu_check.sh runs it, after the
CUDA tests, from a fresh clone).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from selfspec.cost_curve import cached_cost_curve, elapsed_seconds
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import load_heads
from selfspec.reports import write_report
from selfspec.shipped import resolve_heads_dir
from selfspec.target import LoadedTarget, TargetSpec, apply_chat_template, cache_root, load_target
from selfspec.target_forward import TargetForward
from selfspec.tree import parse_tree_spec

HELDOUT = Path(__file__).resolve().parents[1] / "train" / "data" / "prompts_heldout.jsonl"
TREES = {"adaptive": "adaptive", "dynamic-24": "dynamic:4,5,24"}

Run = Callable[[list[int]], tuple[list[int], float]]
"""prompt ids -> (new token ids, tau)"""


@dataclass
class Method:
    name: str
    dtype: str
    kind: str  # "hf", "vanilla", "speculative"
    run: Run
    seconds: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)


def hf_generate(target: LoadedTarget, max_new: int) -> Run:
    model, device = target.model, target.device

    def run(prompt: list[int]) -> tuple[list[int], float]:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new,
                pad_token_id=target.tokenizer.eos_token_id,
            )
        return out[0, len(prompt) :].tolist(), 1.0

    return run


def selfspec_generate(generator: SpeculativeGenerator, config: GenerationConfig) -> Run:
    def run(prompt: list[int]) -> tuple[list[int], float]:
        result = generator.generate(prompt, config)
        return result.token_ids, result.stats.tau

    return run


def build_methods(args: argparse.Namespace) -> list[Method]:
    methods = []
    for dtype in args.dtypes:
        # HF's baseline: transformers' own ops (on a CPU, where selfspec's default is the
        # kernels, a second copy without them); on a GPU both are transformers' ops anyway.
        plain = load_target(
            TargetSpec(model=args.model, dtype=dtype, device=args.device, kernels=False)
        )
        target = load_target(TargetSpec(model=args.model, dtype=dtype, device=args.device))
        methods.append(Method("HF generate", dtype, "hf", hf_generate(plain, args.max_new_tokens)))
        vanilla = SpeculativeGenerator(target.model, None, target.tokenizer)
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, speculate=False)
        methods.append(
            Method("selfspec vanilla", dtype, "vanilla", selfspec_generate(vanilla, config))
        )
        if args.heads == "none":
            continue
        heads = load_heads(resolve_heads_dir(args.heads, args.model is None), target.model)
        curve = cached_cost_curve(TargetForward(target.model), cache_root())
        generator = SpeculativeGenerator(target.model, heads, target.tokenizer, curve)
        for name, text in TREES.items():
            config = GenerationConfig(
                max_new_tokens=args.max_new_tokens, tree=parse_tree_spec(text)
            )
            runner = selfspec_generate(generator, config)
            methods.append(Method(f"selfspec {args.heads} {name}", dtype, "speculative", runner))
    return methods


def top2_gap(target: LoadedTarget, tokens: list[int]) -> float:
    """Vanilla's top-2 logit gap for the token after ``tokens`` (one plain forward)."""
    ids = torch.tensor([tokens], device=target.device)
    with torch.inference_mode():
        logits = target.model(ids).logits[0, -1].float()  # [vocab]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def divergences(
    method: Method, reference: Method, prompts: list[list[int]], target: LoadedTarget
) -> list[dict]:
    found = []
    for index, (out, ref, prompt) in enumerate(
        zip(method.outputs, reference.outputs, prompts, strict=True)
    ):
        if out == ref:
            continue
        at = next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), None)
        if at is None:  # one is a prefix of the other: a stop seen by one only
            at = min(len(out), len(ref))
        gap = top2_gap(target, prompt + ref[:at])
        found.append({"prompt": index, "position": at, "vanilla_top2_gap": round(gap, 6)})
    return found


def _equal(method: Method, reference: Method) -> int:
    return sum(a == b for a, b in zip(method.outputs, reference.outputs, strict=True))


def summarise(
    methods: list[Method],
    prompts: list[list[int]],
    args: argparse.Namespace,
    device: torch.device,
) -> dict:
    def rate(m: Method) -> float:
        return sum(len(o) for o in m.outputs) / sum(m.seconds)

    rows = []
    checkers: dict[str, LoadedTarget] = {}
    for m in methods:
        hf = next(x for x in methods if x.dtype == m.dtype and x.kind == "hf")
        vanilla = next(x for x in methods if x.dtype == m.dtype and x.kind == "vanilla")
        if m.dtype not in checkers:
            checkers[m.dtype] = load_target(
                TargetSpec(model=args.model, dtype=m.dtype, device=args.device, kernels=False)
            )
        row = {
            "method": m.name,
            "dtype": m.dtype,
            "tokens_per_second": round(rate(m), 2),
            "speedup_vs_hf": round(rate(m) / rate(hf), 3),
            "tau": round(statistics.mean(m.taus), 3),
            "equal_to_vanilla": f"{_equal(m, vanilla)}/{len(prompts)}",
            "equal_to_hf": f"{_equal(m, hf)}/{len(prompts)}",
            "new_tokens": sum(len(o) for o in m.outputs),
            "seconds": round(sum(m.seconds), 3),
        }
        if m is not vanilla:
            row["divergences_from_vanilla"] = divergences(m, vanilla, prompts, checkers[m.dtype])
        rows.append(row)
    return {
        "machine": {
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "cpu_threads": torch.get_num_threads(),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        },
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": args.model or "SmolLM2-135M-Instruct (default)",
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "rows": rows,
    }


def markdown(report: dict) -> str:
    machine = report["machine"]
    where = machine["gpu"] or machine["device"]
    lines = [
        f"GPU check, greedy, batch 1: {report['model']}, {report['prompts']} held-out prompts x "
        f"up to {report['max_new_tokens']} new tokens on {where} (torch {machine['torch']}, "
        f"CUDA {machine['cuda']}, transformers {machine['transformers']}), {report['date']}.",
        "",
        "| method | dtype | tok/s | × HF generate | τ | equal to vanilla | equal to HF | "
        "divergences (vanilla top-2 gap) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        diverged = ", ".join(
            f"p{d['prompt']}@{d['position']} ({d['vanilla_top2_gap']:.2g})"
            for d in r.get("divergences_from_vanilla", [])
        )
        lines.append(
            f"| {r['method']} | {r['dtype']} | {r['tokens_per_second']:.1f} | "
            f"{r['speedup_vs_hf']:.2f} | {r['tau']:.2f} | {r['equal_to_vanilla']} | "
            f"{r['equal_to_hf']} | {diverged} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda | cuda:N | auto | cpu")
    parser.add_argument("--model", default=None, help="local model dir or .gguf; default SmolLM2")
    parser.add_argument("--heads", default="eagle", help="'eagle', 'medusa', a dir, or 'none'")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=Path, default=HELDOUT, help="JSONL of {prompt: ...}")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"))
    args = parser.parse_args()
    try:
        TargetSpec(device=args.device).resolve_device()
    except ValueError as error:  # TargetLoadError: no GPU, or no such GPU
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    methods = build_methods(args)
    tokenizer = load_target(TargetSpec(model=args.model)).tokenizer
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [apply_chat_template(tokenizer, r["prompt"]) for r in rows[: args.num_prompts]]
    device = TargetSpec(device=args.device).resolve_device()  # what the targets were put on
    for method in methods:  # warm-up: allocation, cuBLAS handles, kernel selection
        method.run(prompts[0][:16])
    for index, ids in enumerate(prompts):
        for method in methods:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            tokens, tau = method.run(ids)
            method.seconds.append(elapsed_seconds(started, device))
            method.outputs.append(tokens)
            method.taus.append(tau)
        print(f"prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    report = summarise(methods, prompts, args, device)
    write_report(args.out, report, markdown(report), stem="gpu_check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
