"""Side-by-side decoding speed on the embedded default model: baselines and selfspec, one process.

Every method runs on every prompt, prompt-major (prompt 1 through all methods, then prompt 2 ...),
so background noise on a shared machine spreads over all of them alike. Reported per method:
tokens/s (new tokens over the whole generate call, prefill included, for every method alike), τ,
speedup over the faster vanilla HF baseline (fp32 or bf16) and over HF prompt-lookup decoding
(the faster dtype), and how many outputs equal selfspec's vanilla greedy in the same mode
(llama.cpp's: in float32, the exact model of the same file). HF's rows run the model as HF
ships it; selfspec's run the row-invariant kernels (`selfspec.kernels`, `--kernels`) in every
mode given to `--dtypes` (float32, bfloat16, int8, int4); in float32 and bfloat16 two extra
vanilla rows show the engine's layers: selfspec's loop over HF's body, then over its lean body
with torch's ops (bf16: packed weights). `--llama-cpp` adds llama.cpp on the same GGUF file.

    .venv/bin/python benchmarks/speed.py --num-prompts 8 --max-new-tokens 96 --out runs/speed

Greedy, batch 1. With the kernels, speculative output equals vanilla token for token in every
mode: every op computes a token the same whatever shares its forward. The `equal` column checks
it on every prompt.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.cost_curve import CostCurve, cached_cost_curve, cpu_flags, cpu_model
from selfspec.draft_options import CONTEXT_MODES, add_context_draft_arguments
from selfspec.drafting.context import ContextDrafts
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import load_heads
from selfspec.modes import split_mode
from selfspec.reports import write_report
from selfspec.shipped import resolve_corpus, resolve_heads_dir
from selfspec.target import (
    LoadedTarget,
    TargetSpec,
    apply_chat_template,
    cache_root,
    default_gguf_path,
    load_target,
)
from selfspec.target_forward import TargetForward
from selfspec.tree import DynamicTree, TreeSpec, parse_tree_spec

PACKING = {"auto": None, "on": True, "off": False}
KERNELS = {"auto": None, "on": True, "off": False}
HF_DTYPES = ("float32", "bfloat16")  # the modes transformers runs itself
HELDOUT = Path(__file__).resolve().parents[1] / "train" / "data" / "prompts_heldout.jsonl"


@dataclass
class Method:
    name: str
    dtype: str
    run: Callable[[list[int]], tuple[list[int], float, float]]
    """prompt ids -> (new token ids, τ, mean tree tokens per verification forward)"""
    kind: str  # "hf", "lookup", "vanilla", "speculative"
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    tree_sizes: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


def hf_generate(target: LoadedTarget, max_new: int, lookup: int = 0) -> Callable:
    model = target.model
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}

    def run(prompt: list[int]) -> tuple[list[int], float]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new,
                pad_token_id=target.tokenizer.eos_token_id,
                **extra,
            )
        return out[0, len(prompt) :].tolist(), float("nan"), float("nan")

    return run


def selfspec_generate(
    generator: SpeculativeGenerator,
    max_new: int,
    speculate: bool,
    tree: TreeSpec | None,
    context_drafts: ContextDrafts | None = None,
) -> Callable:
    config = GenerationConfig(
        max_new_tokens=max_new, speculate=speculate, tree=tree, context_drafts=context_drafts
    )

    def run(prompt: list[int]) -> tuple[list[int], float]:
        result = generator.generate(prompt, config)
        steps = result.stats.steps
        size = statistics.mean(s.tree_size for s in steps) if steps else float("nan")
        return result.token_ids, result.stats.tau, size

    return run


def llama_cpp_generate(max_new: int, threads: int | None) -> Callable:
    """llama.cpp (``llama-cpp-python``) on the same GGUF file, greedy, the same threads: the CPU
    anchor. Stops at EOS (kept, as selfspec keeps it) or after ``max_new`` tokens."""
    from llama_cpp import Llama

    threads = threads or torch.get_num_threads()
    model = Llama(
        model_path=str(default_gguf_path()),
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    eos = model.token_eos()

    def run(prompt: list[int]) -> tuple[list[int], float]:
        tokens: list[int] = []
        for token in model.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if token == eos or len(tokens) >= max_new:
                break
        return tokens, float("nan"), float("nan")

    return run


def build_methods(args: argparse.Namespace) -> tuple[list[Method], dict[str, CostCurve]]:
    methods: list[Method] = []
    curves: dict[str, CostCurve] = {}
    trees = {name: parse_tree_spec(text) for name, text in (t.split("=", 1) for t in args.trees)}
    packing = PACKING[args.packed_weights]
    n = args.max_new_tokens
    for dtype in args.dtypes:
        # "float32:float" / "float32:int24": float32 with that activation arithmetic
        name, activations = split_mode(dtype)
        spec = TargetSpec(
            dtype=name,
            threads=args.threads,
            kernels=KERNELS[args.kernels],
            activations=activations,
        )
        target = load_target(spec)
        if dtype in HF_DTYPES:
            # HF's baselines run the model as HF ships it: its own ops, unpacked weights.
            plain = load_target(
                TargetSpec(dtype=dtype, threads=args.threads, kernels=False, packed_weights=False)
            )
            methods.append(Method("HF generate", dtype, hf_generate(plain, n), "hf"))
            methods.append(
                Method(
                    f"HF prompt lookup ({args.lookup})",
                    dtype,
                    hf_generate(plain, n, args.lookup),
                    "lookup",
                )
            )
            # What each engine layer gives: selfspec's loop over HF's body as shipped, then
            # with torch's ops in the lean body (bf16: packed), then ("selfspec vanilla") the
            # row-invariant kernels.
            torch_ops = load_target(
                TargetSpec(dtype=dtype, threads=args.threads, kernels=False, packed_weights=packing)
            )
            engine = [
                (
                    "HF body",
                    SpeculativeGenerator(plain.model, None, plain.tokenizer, lean_body=False),
                ),
                ("torch ops", SpeculativeGenerator(torch_ops.model, None, torch_ops.tokenizer)),
            ]
            if spec.kernels is False:
                engine = engine[:1]
            for label, generator in engine:
                runner = selfspec_generate(generator, n, False, None)
                methods.append(
                    Method(f"selfspec vanilla, {label}", dtype, runner, "vanilla-engine")
                )
        curve = cached_cost_curve(TargetForward(target.model), cache_root())
        curves[dtype] = curve
        vanilla = SpeculativeGenerator(target.model, None, target.tokenizer)
        corpus = resolve_corpus(args.draft_corpus, True, target.model)  # once for every heads set
        methods.append(
            Method("selfspec vanilla", dtype, selfspec_generate(vanilla, n, False, None), "vanilla")
        )
        for spec_name in args.heads:
            heads = load_heads(resolve_heads_dir(spec_name, True), target.model)
            label = Path(spec_name).name if Path(spec_name).is_dir() else spec_name
            generator = SpeculativeGenerator(target.model, heads, target.tokenizer, curve)
            if not args.speculation_gate:
                generator.gate = None  # adaptive trees draft at every step: the sizer alone
            generator.corpus = corpus
            deepest = heads.config.num_heads if heads.config.kind.value == "medusa" else None
            for tree_name, tree in trees.items():
                if deepest is not None and tree is not None and tree.depth > deepest:
                    if not isinstance(tree, DynamicTree):
                        continue  # a static tree deeper than the Medusa heads: not runnable
                    tree = replace(tree, depth=deepest)
                for with_context in CONTEXT_MODES[args.context_drafts]:
                    drafts = ContextDrafts() if with_context else None
                    runner = selfspec_generate(generator, n, True, tree, drafts)
                    name = f"selfspec {label} {tree_name}" + (" + context" if with_context else "")
                    methods.append(Method(name, dtype, runner, "speculative"))
    if args.llama_cpp:
        runner = llama_cpp_generate(n, args.threads)
        methods.append(Method("llama.cpp (same GGUF file)", "gguf", runner, "llama.cpp"))
    return methods, curves


def read_prompts(path: Path, count: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["prompt"] for row in rows[:count]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=HELDOUT, help="JSONL of {prompt: ...}")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        help="modes; float32:float / float32:int24 pick float32's activation arithmetic "
        "(TargetSpec.activations; plain float32: auto)",
    )
    parser.add_argument(
        "--heads", nargs="+", default=["eagle", "medusa"], help="'eagle', 'medusa' or heads dirs"
    )
    parser.add_argument(
        "--trees",
        nargs="+",
        default=[
            "adaptive=adaptive",
            "dynamic-8=dynamic:4,4,8",
            "dynamic-24=dynamic:4,5,24",
            "static=static",
        ],
        help="NAME=TREE_SPEC pairs (see `selfspec generate --tree`)",
    )
    parser.add_argument(
        "--packed-weights",
        choices=sorted(PACKING),
        default="auto",
        help="selfspec's targets: oneDNN-packed linear weights (auto: in bfloat16); HF's "
        "baselines always run unpacked. When packed, an unpacked vanilla row (HF body) is added",
    )
    parser.add_argument(
        "--kernels",
        choices=sorted(KERNELS),
        default="auto",
        help="selfspec's targets: the row-invariant kernels (auto: C++ where built, else the "
        "torch fallback; off: transformers' ops, float32/bfloat16 only)",
    )
    add_context_draft_arguments(parser)
    parser.add_argument(
        "--no-speculation-gate",
        dest="speculation_gate",
        action="store_false",
        help="adaptive trees draft at every step (the tree sizer alone, no per-step gate)",
    )
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="add llama.cpp on the same GGUF file (needs `pip install llama-cpp-python`)",
    )
    parser.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--out", type=Path, default=Path("runs/speed"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts = read_prompts(args.prompts, args.num_prompts)
    methods, curves = build_methods(args)
    tokenizer = load_target(TargetSpec()).tokenizer
    prompt_ids = [apply_chat_template(tokenizer, p) for p in prompts]
    for method in methods:  # warm-up: first calls pay for allocation and kernel selection
        method.run(prompt_ids[0][:16])
    with tqdm(total=len(prompts) * len(methods), desc="speed", unit="run") as bar:
        for ids in prompt_ids:
            for method in methods:
                started = time.perf_counter()
                tokens, tau, tree_size = method.run(ids)
                method.seconds.append(time.perf_counter() - started)
                method.tokens.append(len(tokens))
                method.taus.append(tau)
                method.tree_sizes.append(tree_size)
                method.outputs.append(tokens)
                bar.update()
    report = summarise(methods, curves, args, prompts)
    write_report(args.out, report, markdown(report), stem="speed")
    return 0


def summarise(
    methods: list[Method], curves: dict[str, CostCurve], args: argparse.Namespace, prompts: list
) -> dict:
    def rate(m: Method) -> float:
        return sum(m.tokens) / sum(m.seconds)

    baseline = max((m for m in methods if m.kind == "hf"), key=rate)
    lookup = max((m for m in methods if m.kind == "lookup"), key=rate)
    vanilla = {m.dtype: m for m in methods if m.kind == "vanilla"}
    rows = []
    for m in methods:
        # llama.cpp is compared with selfspec's float32 vanilla: the same file's exact model.
        reference = vanilla.get(
            m.dtype, vanilla.get("float32", next(iter(vanilla.values())))
        ).outputs
        equal = sum(out == ref for out, ref in zip(m.outputs, reference, strict=True))
        taus = [t for t in m.taus if t == t]
        sizes = [t for t in m.tree_sizes if t == t]
        rows.append(
            {
                "method": m.name,
                "dtype": m.dtype,
                "tokens_per_second": round(rate(m), 2),
                "tau": round(statistics.mean(taus), 2) if taus else None,
                "mean_tree_tokens": round(statistics.mean(sizes), 1) if sizes else None,
                "speedup_vs_hf": round(rate(m) / rate(baseline), 2),
                "speedup_vs_lookup": round(rate(m) / rate(lookup), 2),
                "equal_to_vanilla": f"{equal}/{len(reference)}",
                "new_tokens": sum(m.tokens),
                "seconds": round(sum(m.seconds), 2),
            }
        )
    return {
        "machine": {
            "cpu": cpu_model(),
            "flags": cpu_flags(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d"),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "baseline": f"{baseline.name} ({baseline.dtype})",
        "lookup_baseline": f"{lookup.name} ({lookup.dtype})",
        "cost_curves": {d: c.relative() for d, c in curves.items()},
        "rows": rows,
    }


def markdown(report: dict) -> str:
    machine = report["machine"]
    lines = [
        f"Speed, greedy, batch 1: {report['prompts']} held-out prompts x "
        f"{report['max_new_tokens']} new tokens; {machine['cpu']} "
        f"({' '.join(machine.get('flags', []))}), {machine['threads']} threads, "
        f"torch {machine['torch']}, "
        f"{report['date']}. Baselines: {report['baseline']}, {report['lookup_baseline']}.",
        "",
        "| method | mode | tok/s | τ | tree tokens | × HF | × lookup | equal to vanilla |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        size = "" if r.get("mean_tree_tokens") is None else f"{r['mean_tree_tokens']:.1f}"
        lines.append(
            f"| {r['method']} | {r['dtype']} | {r['tokens_per_second']:.1f} | {tau} | {size} | "
            f"{r['speedup_vs_hf']:.2f} | {r['speedup_vs_lookup']:.2f} | {r['equal_to_vanilla']} |"
        )
    lines.append("")
    for dtype, relative in report["cost_curves"].items():
        curve = ", ".join(f"{size}: {cost:.2f}" for size, cost in relative.items())
        lines.append(f"Verification cost vs tree tokens ({dtype}, relative to 1 token): {curve}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
