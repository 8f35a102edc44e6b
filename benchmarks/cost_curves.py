"""Verification cost curves side by side: one target forward (body + lm_head) over a tree of
1..64 tokens, for transformers' own ops and for selfspec's row-invariant kernels in every mode,
at 1 and 2 threads, in one process. The CPU's flags are printed with the table.

    .venv/bin/python benchmarks/cost_curves.py --out runs/cost-curves --plot docs/cost_curves.png

Reported per configuration: milliseconds of a 1-token forward, and the cost of each tree size
relative to it (the issue's targets: 16 tokens <= 1.3x, 64 <= 2.0x); plus each configuration's
1-token time relative to transformers' fp32 path. "GGUF blocks": float32 computed from the
file's own quantized blocks (selfspec's default for a GGUF target; the same bits as dense
fp32). "forced avx2" rows run the AVX2 path on this CPU (SELFSPEC_KERNEL_ISA=avx2): evidence
for AVX2 machines only as far as that goes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.atomic import write_file_atomic
from selfspec.cost_curve import cpu_flags, cpu_model, measure_cost_curve
from selfspec.kernels import extension
from selfspec.reports import write_report
from selfspec.target import TargetSpec, load_target
from selfspec.target_forward import TargetForward

SIZES = (1, 2, 4, 8, 16, 32, 64)
# name: (dtype, kernels, instruction-set path or None, GGUF blocks in float32, float32's
# activations: TargetSpec.activations)
CONFIGS = {
    "torch fp32": ("float32", False, None, False, "auto"),
    "torch bf16 (packed)": ("bfloat16", False, None, False, "auto"),
    "kernels fp32, dense": ("float32", None, None, False, "auto"),
    "kernels fp32, GGUF blocks": ("float32", None, None, True, "float"),
    "kernels fp32, GGUF blocks, int24 activations": ("float32", None, None, True, "int24"),
    "kernels bf16": ("bfloat16", None, None, False, "auto"),
    "kernels int8": ("int8", None, None, False, "auto"),
    "kernels int4": ("int4", None, None, False, "auto"),
    "kernels w4a8 (int8 activations)": ("w4a8", None, None, False, "auto"),
    "kernels fp32 dense, forced avx2": ("float32", None, "avx2", False, "auto"),
    "kernels int4, forced avx2": ("int4", None, "avx2", False, "auto"),
    # bf16 without the CPU's bf16 dot products (the same bits, fused multiply-adds)
    "kernels bf16, forced avx2": ("bfloat16", None, "avx2", False, "auto"),
}


def measure(name: str, threads: int, repeats: int) -> dict:
    dtype, kernels, isa, blocks, activations = CONFIGS[name]
    if isa is not None:
        os.environ[extension.ISA_ENV] = isa
    try:
        torch.set_num_threads(threads)
        spec = TargetSpec(dtype=dtype, kernels=kernels, gguf_blocks=blocks, activations=activations)
        target = load_target(spec)
        curve = measure_cost_curve(TargetForward(target.model), SIZES, repeats=repeats)
    finally:
        os.environ.pop(extension.ISA_ENV, None)
    return {
        "config": name,
        "threads": threads,
        "one_token_ms": round(curve.at(1) * 1000, 2),
        "relative": {str(s): round(r, 3) for s, r in curve.relative().items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("runs/cost-curves"))
    parser.add_argument("--plot", type=Path, default=None, help="also draw the curves (PNG)")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="redraw table and plot from a saved report"
    )
    args = parser.parse_args()
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        print(markdown(report))
        if args.plot:
            plot(report, args.plot)
        return 0
    configs = [c for c in args.configs if CONFIGS[c][2] is None or extension.active_isa()]
    rows = []
    runs = [(c, t) for t in args.threads for c in configs]
    for name, threads in tqdm(runs, desc="cost curves", unit="config"):
        rows.append(measure(name, threads, args.repeats))
    report = {
        "cpu": cpu_model(),
        "flags": cpu_flags(),
        "kernel_path": extension.active_isa() or "torch fallback",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "sizes": list(SIZES),
        "rows": rows,
    }
    write_report(args.out, report, markdown(report), stem="cost_curves")
    if args.plot:
        plot(report, args.plot)
    return 0


def markdown(report: dict) -> str:
    lines = [
        f"Verification cost, SmolLM2-135M, 128 cached tokens; {report['cpu']} "
        f"(flags: {' '.join(report['flags'])}); kernels on {report['kernel_path']}; "
        f"torch {report['torch']}; {report['date']}",
        "",
        "| config | threads | 1 token ms | vs torch fp32 | "
        + " | ".join(f"{s}" for s in report["sizes"][1:])
        + " |",
        "|---|---:|---:|---:|" + "---:|" * (len(report["sizes"]) - 1),
    ]
    reference = {
        r["threads"]: r["one_token_ms"] for r in report["rows"] if r["config"] == "torch fp32"
    }
    for row in report["rows"]:
        base = reference.get(row["threads"])
        speed = f"{base / row['one_token_ms']:.2f}x" if base else ""
        cells = " | ".join(f"{row['relative'][str(s)]:.2f}" for s in report["sizes"][1:])
        name, ms = row["config"], row["one_token_ms"]
        lines.append(f"| {name} | {row['threads']} | {ms:.1f} | {speed} | {cells} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({r["threads"] for r in report["rows"]})
    figure, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4.5), squeeze=False)
    for axis, count in zip(axes[0], threads, strict=True):
        for row in (r for r in report["rows"] if r["threads"] == count):
            sizes = report["sizes"]
            ms = [row["one_token_ms"] * row["relative"][str(s)] for s in sizes]
            style = "--" if row["config"].startswith("torch") else "-"
            axis.plot(sizes, ms, style, marker="o", markersize=3, label=row["config"])
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("tree tokens per forward")
        axis.set_ylabel("ms per forward (body + lm_head)")
        axis.set_title(f"{count} thread{'s' if count > 1 else ''}")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.suptitle(f"Verification cost, SmolLM2-135M: {report['cpu']}", fontsize=9)
    figure.tight_layout()
    write_file_atomic(path, lambda temporary: figure.savefig(temporary, dpi=110))
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
