"""Plot a robustness report: τ and speedup per adapter against the base, and each row's
acceptance per tree depth."""

from __future__ import annotations

from pathlib import Path

from selfspec.adapters.robustness import RobustnessReport
from selfspec.atomic import write_file_atomic


def plot_report(report: RobustnessReport, path: Path) -> Path:
    """Write a PNG with three panels (τ and speedup, one bar per row; acceptance against depth,
    one line per row); written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = [f"{row.name} (own heads)" if row.heads == "own" else row.name for row in report.rows]
    colors = ["#7f7f7f"] + ["#1f77b4"] * (len(names) - 1)
    figure, (tau_axis, speed_axis, depth_axis) = plt.subplots(
        1, 3, figsize=(8 + 1.2 * len(names), 4)
    )
    panels = (
        (tau_axis, [row.tau for row in report.rows], "τ (tokens per target forward)"),
        (speed_axis, [row.speedup for row in report.rows], "speedup vs vanilla (decode tok/s)"),
    )
    for axis, values, title in panels:
        axis.bar(names, values, color=colors)
        axis.axhline(values[0], color="#7f7f7f", linestyle="--", linewidth=1, label="base")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_title(title)
        axis.tick_params(axis="x", rotation=30)
        for x, value in enumerate(values):
            axis.annotate(f"{value:.2f}", (x, value), ha="center", va="bottom", fontsize=8)
    for name, row in zip(names, report.rows, strict=True):
        rates = row.acceptance_by_depth
        style = {"color": "#7f7f7f", "linestyle": "--"} if row is report.rows[0] else {}
        depth_axis.plot(range(1, len(rates) + 1), rates, marker="o", label=name, **style)
    depth_axis.set_title("acceptance at tree depth d")
    depth_axis.set_xlabel("depth d")
    depth_axis.set_ylim(0, 1)
    depth_axis.legend(fontsize=7)
    settings = report.settings
    figure.suptitle(f"{settings.get('target', '')}, heads: {settings.get('heads', '')}")
    figure.tight_layout()
    try:
        return write_file_atomic(path, lambda temporary: figure.savefig(temporary, dpi=120))
    finally:
        plt.close(figure)
