"""τ on the held-out benchmark set against the response tokens the heads were trained on.

Reads heads snapshots (``selfspec train`` with ``--export.snapshot_every_tokens N`` writes
``<export dir>-snapshots/tokens-<N>/``; any heads directory whose ``metrics.json`` records
``response_tokens_seen_this_run_rank0`` works too), measures each with
``benchmarks/tau_heldout.py`` (fixed dynamic tree 10/7/60, fp32, 96 tokens, the same
deduplication check), and plots mean τ per temperature against the tokens, with the goal line.

    .venv/bin/python benchmarks/tau_vs_tokens.py runs/eagle3-engine-snapshots/* runs/eagle3-engine \
        --limit 2 --out runs/tau_vs_tokens --plot docs/tau_vs_tokens.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tau_heldout  # noqa: E402

GOALS = {0.0: 3.0, 1.0: 2.6}


def tokens_of(heads: Path) -> int:
    """Response tokens the heads were trained on: over all runs where a run continued from
    earlier heads (``response_tokens_total``), else this run's."""
    try:
        record = json.loads((heads / "metrics.json").read_text())
        key = "response_tokens_total"
        return int(record[key] if key in record else record["response_tokens_seen_this_run_rank0"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        message = f"error: {heads}/metrics.json records no response tokens: {error}"
        raise SystemExit(message) from error


def plot(points: dict[float, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from selfspec.atomic import write_file_atomic

    figure, axis = plt.subplots(figsize=(6.5, 4))
    for temperature, series in sorted(points.items()):
        xs, ys = zip(*sorted(series), strict=True)
        label = "greedy (T=0)" if temperature == 0 else f"T={temperature:g}"
        axis.plot(xs, ys, marker="o", label=f"mean τ, {label}")
        if temperature in GOALS:
            axis.axhline(GOALS[temperature], linestyle="--", linewidth=0.8, color="grey")
    axis.set_xlabel("response tokens trained on")
    axis.set_ylabel("mean τ on the held-out set (tree 10/7/60)")
    axis.set_title("EAGLE-3 heads on data-engine data: τ vs training tokens")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    write_file_atomic(path, lambda tmp: figure.savefig(tmp, dpi=120))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", type=Path, nargs="+", help="heads directories (snapshots)")
    parser.add_argument("--limit", type=int, default=None, help="prompts per category")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--train-data", type=Path, action="append", default=[])
    parser.add_argument("--out", type=Path, default=Path("runs/tau_vs_tokens"))
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (e.g. docs/...)")
    args = parser.parse_args(argv)
    named = {f"tokens-{tokens_of(h)}": h for h in args.heads}
    command = [
        "--shipped",
        "--no-plot",
        "--out",
        str(args.out),
        "--temperatures",
        *map(str, args.temperatures),
    ]
    for name, heads in named.items():
        command += ["--heads", f"{name}={heads}"]
    for data in args.train_data:
        command += ["--train-data", str(data)]
    if args.limit is not None:
        command += ["--limit", str(args.limit)]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    code = tau_heldout.main(command)
    if code != 0:
        return code
    report = json.loads((args.out / "results.json").read_text())
    points: dict[float, list[tuple[int, float]]] = {}
    for run in report["rows"]:
        if run["heads"] in named:
            tokens = int(run["heads"].split("-", 1)[1])
            points.setdefault(float(run["temperature"]), []).append((tokens, run["mean_tau"]))
    lines = [
        "| response tokens | " + " | ".join(f"τ T={t:g}" for t in sorted(points)) + " |",
        "|---:|" + "---:|" * len(points),
    ]
    for tokens in sorted({x for series in points.values() for x, _ in series}):
        cells = [f"{dict(points[t]).get(tokens, float('nan')):.2f}" for t in sorted(points)]
        lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
    (args.out / "tau_vs_tokens.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.plot is not None:
        plot(points, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
