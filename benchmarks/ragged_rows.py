"""Trees verified back to back (ragged) vs padded to the largest, side by side (issue #18).

The server verifies the running requests' trees in one whole-body forward. Since 2026-12-08 the
trees run back to back (``LeanBody.rows_forward``: each request's rows over its own cache, no
padding); before, every tree was padded to the largest. This times one such forward both ways on
the default model: B requests with P-token caches and trees of the given sizes (masks that let
each node see its cache and the nodes before it; the cost does not depend on the mask), under no
adapter, one adapter for all, and one adapter per request (random rank-16 LoRA weights on every
linear layer of the body), alternating the two layouts. Prints the median milliseconds of each
and their ratio.

    .venv/bin/python benchmarks/ragged_rows.py --sizes 3 6 1 4 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.adapters.fast_lora import LoraBank, LoraWeights
from selfspec.generation import SpeculativeGenerator
from selfspec.growing_cache import growing_cache
from selfspec.kv_commit import drop_uncommitted
from selfspec.reports import machine_record, write_report
from selfspec.target import TargetSpec, load_target

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_bank(model: torch.nn.Module, names: list[str], rank: int) -> LoraBank:
    """A LoRA bank with one random rank-``rank`` adapter per name on every body linear."""
    bank = LoraBank(model)
    generator = torch.Generator().manual_seed(0)
    for name in names:
        weights = {}
        for module_name, module in model.named_modules():
            if ".layers." in module_name and module_name.rsplit(".", 1)[-1] in LINEARS:
                a = torch.randn(rank, module.in_features, generator=generator) * 0.01
                b = torch.randn(module.out_features, rank, generator=generator) * 0.01
                weights[module_name] = LoraWeights(a, b, 2.0)
        bank.add(name, weights)
    return bank


def forwards(lean, config, sizes: list[int], cached: int) -> dict[str, Callable[[], None]]:
    """The ragged and the padded forward of trees of ``sizes`` over ``cached``-token caches,
    each leaving its caches as it found them."""
    batch, width, total = len(sizes), max(sizes), sum(sizes)
    generator = torch.Generator().manual_seed(1)
    own = [growing_cache(config) for _ in sizes]
    with torch.inference_mode():
        for cache in own:
            prompt = torch.randint(10, 1000, (1, cached), generator=generator)
            lean(prompt, torch.arange(cached)[None], cache)
        shared = growing_cache(config)
        prompt = torch.randint(10, 1000, (batch, cached), generator=generator)
        lean(prompt, torch.arange(cached)[None].expand(batch, cached), shared)
    tokens = torch.randint(10, 1000, (1, total), generator=generator)
    positions = torch.cat([cached + torch.arange(n) for n in sizes])[None]
    masks = [_causal(cached, n)[0] for n in sizes]  # [1, n, cached + n] each
    padded_tokens = torch.randint(10, 1000, (batch, width), generator=generator)
    padded_positions = (cached + torch.arange(width)).expand(batch, width)
    padded_mask = _causal(cached, width).expand(batch, 1, width, cached + width)

    def ragged() -> None:
        with torch.inference_mode():
            if lean.rows_forward(tokens, positions, own, sizes, masks) is None:
                raise RuntimeError("the whole body cannot run here (kernels not built?)")
        for cache in own:
            drop_uncommitted(cache, cached)

    def padded() -> None:
        with torch.inference_mode():
            lean(padded_tokens, padded_positions, shared, padded_mask)
        drop_uncommitted(shared, cached)

    return {"ragged": ragged, "padded": padded}


def _causal(cached: int, size: int) -> torch.Tensor:
    """# [1, 1, size, cached + size] additive: the cache and the nodes up to each."""
    blocked = torch.ones(size, size, dtype=torch.bool).triu(1)
    mask = torch.zeros(1, 1, size, cached + size)
    mask[0, 0, :, cached:] = torch.where(blocked, torch.finfo(torch.float32).min, 0.0)
    return mask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 6, 1, 4], help="tree sizes")
    parser.add_argument("--cached", type=int, default=100, help="tokens in each request's cache")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/ragged_rows"))
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or args.cached < 1 or args.repeats < 1:
        parser.error("--sizes, --cached and --repeats must be >= 1")
    target = load_target(TargetSpec(threads=args.threads))
    lean = SpeculativeGenerator(target.model, None).target.lean
    if lean is None:
        parser.error("the default model has no lean body here")
    names = [f"adapter-{i}" for i in range(len(args.sizes))]
    bank = random_bank(target.model, names, args.rank)
    runs = forwards(lean, target.model.config, args.sizes, args.cached)
    selections = {
        "no adapter": lambda: bank.select(None),
        "one adapter": lambda: bank.select(names[0]),
        "an adapter per request": lambda: bank.select_rows(names),
    }
    rows = []
    for label, select in selections.items():
        select()
        for run in runs.values():
            run()  # warm
        times: dict[str, list[float]] = {name: [] for name in runs}
        for repeat in tqdm(range(args.repeats), desc=label, leave=False):
            order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
            for name in order:
                started = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - started)
        ragged, padded = (statistics.median(times[n]) * 1e3 for n in ("ragged", "padded"))
        rows.append({"adapters": label, "ragged_ms": ragged, "padded_ms": padded})
    machine = machine_record()
    sizes = ", ".join(map(str, args.sizes))
    table = (
        f"Trees of {sizes} nodes over {args.cached}-token caches, SmolLM2-135M (float32, int24 "
        f"activations where the CPU has VNNI), {args.threads} thread(s); {machine['cpu']} "
        f"({' '.join(machine['flags'])}); median of {args.repeats}, alternated.\n\n"
        "| adapters | back to back (ms) | padded to the largest (ms) | ratio |\n"
        "|---|---:|---:|---:|\n"
        + "".join(
            f"| {r['adapters']} | {r['ragged_ms']:.1f} | {r['padded_ms']:.1f} | "
            f"{r['ragged_ms'] / r['padded_ms']:.2f} |\n"
            for r in rows
        )
    )
    report = {"config": vars(args) | {"out": str(args.out)}, "machine": machine, "rows": rows}
    write_report(args.out, report, table, stem="ragged_rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
