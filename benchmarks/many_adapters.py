"""1,000 adapters with draft deltas behind one server: memory, load, switch and mixed batches.

Synthesizes `--num-adapters` random LoRA adapters (rank 16 on every linear layer of every
block, peft's format, bf16 on disk), each with a random rank-16 draft delta beside it
(`<adapter>/heads-delta/`, `selfspec.heads.delta`'s format, over the shared heads), and serves
them the way `selfspec serve` does: an `AdapterStore` over the adapters root (the server's
`StoreConfig`: a bounded resident set of LoRA weights, least recently used evicted) and a
`ServerState` whose `generator_for` puts each adapter's delta into the shared heads' `DeltaBank`
and whose `scope_for` is what every step of a request enters. Measured, in one process:

- registration of every adapter (the startup scan: config and safetensors header validated);
- the deltas: load time each, bytes in the bank, RSS growth with all of them registered;
- the LoRA weights: load time each from disk into the resident set (evicting the least recently
  used), the resident set's bytes and RSS growth;
- switch: entering a request's step scope (its LoRA slot selected, its delta active) when the
  previous step ran another resident adapter, with 10, 100, ... deltas registered: it must not
  grow with the number of adapters; a mixed-batch scope (`batch_scope`) likewise;
- mixed batch: one engine round (each row drafts its tree with its own delta, then ONE target
  forward verifies all trees, as `serve.engine` does) with `--batch` rows all on one adapter vs
  each row on a different adapter, interleaved round by round, ratio of medians;
- exactness of the mixed round: each row's tree and verification logits against the same request
  run alone on heads with its delta merged into the weights and a batch of one.

Writes `results.json`, `results.md` and `many_adapters.png` under `--out`. Timings are ratios
measured side by side, never asserts.

    .venv/bin/python benchmarks/many_adapters.py --num-adapters 1000 --out runs/many_adapters
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from selfspec.adapters.fast_lora import is_linear
from selfspec.adapters.store import AdapterStore, StoreConfig
from selfspec.atomic import write_text_atomic
from selfspec.batched_verify import verify_features
from selfspec.cost_curve import cpu_flags, cpu_model
from selfspec.generation import GenerationConfig, GenerationStream, SpeculativeGenerator
from selfspec.heads.delta import (
    DELTA_DIR,
    Delta,
    DeltaConfig,
    delta_modules,
    heads_hash,
    linear_layers,
    save_delta,
)
from selfspec.kv_commit import drop_uncommitted
from selfspec.reports import rss_bytes
from selfspec.serve.app import ServerState
from selfspec.tree import DynamicTree

MARKER = "many_adapters.json"
"""Written last into a generated adapters root: what it holds, so a later run can reuse it."""
PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about a lighthouse in winter.",
    "List three uses of a paper clip.",
    "What is the capital of Australia, and why not Sydney?",
    "Summarise the plot of a detective story in one line.",
    "Give a short tip for learning to cook rice.",
    "Describe a cat to someone who has never seen one.",
    "Why do we have leap years?",
)


@dataclass(frozen=True)
class Synthesis:
    """What the synthetic adapters are."""

    num_adapters: int = 1000
    rank: int = 16
    """LoRA rank of every adapted module."""
    delta_rank: int = 16
    """Rank of every draft delta (the issue's bound: <= 16)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_adapters < 2:
            raise ValueError(f"need at least 2 adapters, got {self.num_adapters}")
        if not 1 <= self.rank <= 64 or not 1 <= self.delta_rank <= 16:
            raise ValueError(f"need 1 <= rank <= 64, 1 <= delta_rank <= 16: {self}")


# -- synthesis ----------------------------------------------------------------------------------


def adapted_modules(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every linear layer of the base but the output layer (peft's "all-linear"):
    name -> (in, out)."""
    output = model.get_output_embeddings()
    found = {}
    for name, module in model.named_modules():
        if name and is_linear(module) and module is not output:
            weight = module.weight
            found[name] = (
                (weight.shape[1], weight.shape[0])
                if isinstance(module, nn.Linear)
                else (weight.shape[0], weight.shape[1])  # Conv1D: weight [in, out]
            )
    return found


def _pool_slices(pool: torch.Tensor, generator: torch.Generator) -> Callable[..., torch.Tensor]:
    """Random-offset windows of one pool of normal samples: distinct, reproducible tensors
    without drawing ~5M fresh samples per adapter."""

    def take(*shape: int) -> torch.Tensor:
        count = shape[0] * shape[1]
        start = int(torch.randint(0, pool.numel() - count, (1,), generator=generator))
        return pool[start : start + count].view(shape)

    return take


def synthesize(
    model: nn.Module, heads: nn.Module, root: Path, spec: Synthesis
) -> dict[str, float | int]:
    """Write `spec.num_adapters` adapters (with deltas) under `root`; reuse a complete set
    written before for the same spec, base and heads. Returns what it did."""
    from peft import LoraConfig

    modules = adapted_modules(model)
    shared_hash = heads_hash(heads)
    record = {
        **spec.__dict__,
        "modules": len(modules),
        "heads_hash": shared_hash,
        "base": model.config.name_or_path,
    }
    marker = root / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == record:
        return {"reused": 1, "seconds": 0.0}
    started = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(spec.seed)
    widest = max(max(i, o) for i, o in modules.values()) * max(spec.rank, spec.delta_rank)
    pool = torch.randn(max(4 * widest, 1 << 22), generator=generator)
    take = _pool_slices(pool, generator)
    leaves = sorted({name.rsplit(".", 1)[-1] for name in modules})
    template = root / ".config-template"
    LoraConfig(r=spec.rank, lora_alpha=2 * spec.rank, target_modules=leaves).save_pretrained(
        str(template)
    )
    config_text = (template / "adapter_config.json").read_text()
    heads_layers = {n: (m.in_features, m.out_features) for n, m in linear_layers(heads).items()}
    delta_config = DeltaConfig(rank=spec.delta_rank, alpha=2.0 * spec.delta_rank)
    for index in range(spec.num_adapters):
        path = root / adapter_name(index)
        path.mkdir(exist_ok=True)
        state = {}
        for name, (fan_in, fan_out) in modules.items():
            lora_a = take(spec.rank, fan_in) / fan_in**0.5  # [r, in]
            lora_b = take(fan_out, spec.rank) * 0.01  # [out, r]
            state[f"base_model.model.{name}.lora_A.weight"] = lora_a.to(torch.bfloat16)
            state[f"base_model.model.{name}.lora_B.weight"] = lora_b.to(torch.bfloat16)
        save_file(state, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(config_text)
        delta = {}
        for name, (fan_in, fan_out) in heads_layers.items():
            delta[f"{name}.lora_A"] = take(spec.delta_rank, fan_in) / fan_in**0.5  # [r, in]
            delta[f"{name}.lora_B"] = take(fan_out, spec.delta_rank) * 0.01  # [out, r]
        save_delta(Delta(delta_config, shared_hash, delta), path / DELTA_DIR)
    shutil.rmtree(template)
    write_text_atomic(marker, json.dumps(record, indent=2))
    return {"reused": 0, "seconds": time.perf_counter() - started}


def adapter_name(index: int) -> str:
    return f"synthetic-{index:04d}"


# -- measuring ----------------------------------------------------------------------------------


def trimmed_rss_bytes() -> int:
    """Resident set size of this process, after handing freed heap back to the OS (glibc)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes()


def quantiles(seconds: Sequence[float]) -> dict[str, float]:
    """Median, p95, p99 and max, in milliseconds."""
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "median_ms": 1e3 * statistics.median(ordered),
        "p95_ms": at(0.95),
        "p99_ms": at(0.99),
        "max_ms": 1e3 * ordered[-1],
        "count": len(ordered),
    }


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def switch_seconds(state: ServerState, names: Sequence[str], repeats: int) -> list[float]:
    """A request's step on `names[i % len]` after a step on another adapter: its step scope
    (the server builds one per request with `scope_for`) made, entered and left."""

    def one(name: str) -> None:
        with state.scope_for(name)():
            pass

    for name in names:  # warm
        one(name)
    rotation = [names[i % len(names)] for i in range(repeats)]
    return [timed(lambda n=name: one(n)) for name in rotation]


def batch_scope_seconds(store: AdapterStore, names: Sequence[str], repeats: int) -> list[float]:
    """Entering and leaving a mixed-batch scope (pins, per-row slots), its rows rotated each
    time so no two successive batches are the same composition."""

    def one(shift: int) -> None:
        with store.batch_scope([*names[shift:], *names[:shift]]):
            pass

    one(0)
    return [timed(lambda i=i: one(i % len(names))) for i in range(repeats)]


# -- the mixed-batch round ----------------------------------------------------------------------


@dataclass
class Rows:
    """`batch` requests mid-decoding, one per row, each with its adapter."""

    names: list[str]
    streams: list[GenerationStream]


def start_rows(
    state: ServerState, prompts: Sequence[Sequence[int]], names: Sequence[str], tree: DynamicTree
) -> Rows:
    """Requests as the server starts them: the adapter's delta loaded, the request's step scope,
    prefill."""
    config = GenerationConfig(max_new_tokens=64, tree=tree)
    streams = []
    for prompt, name in zip(prompts, names, strict=True):
        generator = state.generator_for(name)
        stream = generator.stream(prompt, config, scope=state.scope_for(name))
        stream.start()
        streams.append(stream)
    return Rows(list(names), streams)


def engine_round(
    state: ServerState, rows: Rows
) -> tuple[float, float, list[torch.Tensor], list[torch.Tensor]]:
    """One round of `serve.engine` (drafting, then the trees of every row verified in one target
    forward under a mixed-adapter scope) without its commit: each row's cache is put back, so the
    round can be repeated. Returns (draft seconds, verify seconds, trees, logits)."""
    started = time.perf_counter()
    drafted = [stream.draft(batch_size=len(rows.streams)) for stream in rows.streams]
    drafting = time.perf_counter() - started
    target = rows.streams[0].owner.target
    sizes = [step.tree.size for step in drafted]
    started = time.perf_counter()
    with torch.inference_mode(), state.store.batch_scope(rows.names):
        features = verify_features(
            target,
            [(stream.state, step) for stream, step in zip(rows.streams, drafted, strict=True)],
        )
        logits = target.logits(torch.cat(features)).split(sizes)  # [T_b, vocab] each
    verifying = time.perf_counter() - started
    for stream in rows.streams:
        drop_uncommitted(stream.state.cache, stream.state.committed_len)
    return drafting, verifying, [step.tree.tokens for step in drafted], list(logits)


def merged_heads(shared: nn.Module, delta_dir: Path) -> nn.Module:
    """A copy of the shared heads with the delta added into the weights: W + (alpha / r) B A."""
    from selfspec.heads.delta import load_delta

    delta = load_delta(delta_dir, shared)
    merged = copy.deepcopy(shared)
    with torch.no_grad():
        for module in delta_modules(merged):
            layer = merged.get_submodule(module)
            a, b = delta.state[f"{module}.lora_A"], delta.state[f"{module}.lora_B"]
            layer.weight.add_(delta.config.scale * (b @ a).to(layer.weight.dtype))
    return merged


def rows_alone(
    state: ServerState,
    shared: nn.Module,
    prompts: Sequence[Sequence[int]],
    rows: Rows,
    tree: DynamicTree,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each row's request run alone: heads with its delta merged (no bank), its adapter active
    (store scope), a batch of one. Returns (trees, logits) as `engine_round` does."""
    store, config = state.store, GenerationConfig(max_new_tokens=64, tree=tree)
    trees, logits = [], []
    for prompt, name in zip(prompts, rows.names, strict=True):
        heads = merged_heads(shared, store.info(name).path / DELTA_DIR)
        generator = SpeculativeGenerator(store.base_model, heads, state.tokenizer)
        stream = generator.stream(prompt, config, scope=store.scope(name))
        stream.start()
        alone = Rows([name], [stream])
        _, _, tree_tokens, row_logits = engine_round(state, alone)
        trees.append(tree_tokens[0])
        logits.append(row_logits[0])
    return trees, logits


def compare_rows(
    batched: tuple[list[torch.Tensor], list[torch.Tensor]],
    alone: tuple[list[torch.Tensor], list[torch.Tensor]],
) -> dict[str, float | int]:
    trees_equal = sum(
        torch.equal(a, b) for a, b in zip(batched[0], alone[0], strict=True)
    )  # fmt: skip
    diffs = [
        float((a - b).abs().max()) if a.shape == b.shape else float("inf")
        for a, b in zip(batched[1], alone[1], strict=True)
    ]
    return {"rows": len(diffs), "trees_equal": trees_equal, "max_logit_diff": max(diffs)}


def interleaved(
    state: ServerState, variants: dict[str, Rows], warmup: int, repeats: int
) -> dict[str, dict[str, list[float]]]:
    """Round timings per variant, the variants alternating (order flipped every repeat)."""
    timings = {name: {"draft": [], "verify": [], "round": []} for name in variants}
    order = list(variants)
    for repeat in range(warmup + repeats):
        for name in order if repeat % 2 == 0 else order[::-1]:
            drafting, verifying, _, _ = engine_round(state, variants[name])
            if repeat >= warmup:
                timings[name]["draft"].append(drafting)
                timings[name]["verify"].append(verifying)
                timings[name]["round"].append(drafting + verifying)
    return timings


# -- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    synthesis: Synthesis
    batch: int = 8
    max_resident: int = StoreConfig().max_resident
    """The LoRA resident set's bound (the server's default)."""
    switch_repeats: int = 2000
    round_repeats: int = 20
    warmup: int = 3
    tree: DynamicTree = DynamicTree()
    """A fixed node budget, so every row's tree has the same size in both variants."""

    def __post_init__(self) -> None:
        if not 2 <= self.batch <= min(self.max_resident, self.synthesis.num_adapters):
            raise ValueError(
                f"--batch must be in [2, min(--max-resident, --num-adapters)] (a mixed batch "
                f"pins one resident adapter per row), got {self.batch}"
            )


def run(
    model: nn.Module,
    heads: nn.Module,
    tokenizer,
    model_name: str,
    prompts: Sequence[Sequence[int]],
    root: Path,
    settings: Settings,
    log: Callable[[str], None] = print,
) -> dict:
    """Everything but the report: synthesize (or reuse) under `root`, serve, measure."""
    spec = settings.synthesis
    synthesis = synthesize(model, heads, root, spec)
    log(f"adapters under {root}: {'reused' if synthesis['reused'] else 'written'} "
        f"({synthesis['seconds']:.1f} s)")  # fmt: skip
    shared = copy.deepcopy(heads)  # before the delta bank wraps the heads' layers
    names = [adapter_name(i) for i in range(spec.num_adapters)]
    rss = {"start": trimmed_rss_bytes()}

    started = time.perf_counter()
    store = AdapterStore(
        model,
        root=root,
        config=StoreConfig(max_resident=settings.max_resident),
        base_name=model_name,
    )
    register_seconds = time.perf_counter() - started
    rss["registered"] = trimmed_rss_bytes()
    log(f"registered {len(store.names())} adapters in {register_seconds:.2f} s")
    state = ServerState(
        generator=SpeculativeGenerator(model, heads, tokenizer),
        tokenizer=tokenizer,
        model_name=model_name,
        store=store,
        tree=settings.tree,
    )

    # LoRA weights first: the resident set fills, then every further load evicts one.
    lora_loads = [timed(lambda n=name: store.load(n)) for name in names]
    rss["loras"] = trimmed_rss_bytes()
    resident = list(store.resident())
    log(f"loaded every LoRA once: median {statistics.median(lora_loads) * 1e3:.1f} ms, "
        f"{len(resident)} resident ({store.lora_bytes / 2**20:.0f} MiB)")  # fmt: skip

    # Deltas: every adapter's, registered in the bank as a first request would; switch time
    # measured along the way (the same resident LoRAs, more deltas each time).
    checkpoints = {c for c in (10, 100, 1000) if len(resident) <= c <= spec.num_adapters}
    checkpoints |= {len(resident), spec.num_adapters}
    switch_at, delta_loads, rss_curve = {}, [], []
    order = resident + [n for n in names if n not in resident]  # resident ones first
    for count, name in enumerate(order, start=1):
        delta_loads.append(timed(lambda n=name: state.generator_for(n)))
        if count in checkpoints:
            rss_curve.append((count, trimmed_rss_bytes()))
            switch_at[count] = quantiles(switch_seconds(state, resident, settings.switch_repeats))
            log(f"{count} deltas: switch median {switch_at[count]['median_ms'] * 1e3:.1f} us")
    rss["deltas"] = trimmed_rss_bytes()
    bank = state.delta_bank
    batch_scope = quantiles(batch_scope_seconds(store, resident[: settings.batch], 500))

    # Mixed batch vs one adapter, the same prompts, interleaved.
    batch_prompts = [prompts[i % len(prompts)] for i in range(settings.batch)]
    mixed_names = resident[-settings.batch :]
    variants = {
        "single": start_rows(
            state, batch_prompts, [mixed_names[0]] * settings.batch, settings.tree
        ),
        "mixed": start_rows(state, batch_prompts, mixed_names, settings.tree),
    }
    _, _, trees, logits = engine_round(state, variants["mixed"])
    exactness = compare_rows(
        (trees, logits), rows_alone(state, shared, batch_prompts, variants["mixed"], settings.tree)
    )
    # What the check is worth: the same prompt on another adapter (and delta) differs this much.
    _, _, _, single_logits = engine_round(state, variants["single"])
    exactness["min_logit_diff_across_adapters"] = min(
        float((a - b).abs().max()) if a.shape == b.shape else float("inf")
        for a, b in zip(logits[1:], single_logits[1:], strict=True)
    )
    timings = interleaved(state, variants, settings.warmup, settings.round_repeats)
    medians = {
        variant: {part: statistics.median(values) for part, values in parts.items()}
        for variant, parts in timings.items()
    }
    log(f"mixed/single round: {medians['mixed']['round'] / medians['single']['round']:.3f}")

    heads_bytes = sum(param.nbytes for param in shared.parameters())
    return {
        "settings": {
            **spec.__dict__,
            "batch": settings.batch,
            "max_resident": settings.max_resident,
            "tree": settings.tree.__dict__,
            "switch_repeats": settings.switch_repeats,
            "round_repeats": settings.round_repeats,
        },
        "synthesis": synthesis,
        "registered": len(store.names()),
        "rejected": dict(store.rejected),
        "register_seconds": register_seconds,
        "memory": {
            "rss_bytes": rss,
            "lora_resident": len(resident),
            "lora_bank_bytes": store.lora_bytes,
            "lora_rss_growth_bytes": rss["loras"] - rss["registered"],
            "lora_bytes_per_adapter": store.resident_bytes / max(len(resident), 1),
            "deltas_registered": len(bank._bytes) if bank is not None else 0,
            "delta_bank_bytes": bank.nbytes if bank is not None else 0,
            "delta_rss_growth_bytes": rss["deltas"] - rss["loras"],
            "delta_bytes_per_adapter": (bank.nbytes / spec.num_adapters) if bank else 0,
            "delta_fraction_of_heads": (bank.nbytes / spec.num_adapters / heads_bytes)
            if bank
            else 0,
            "rss_by_deltas": rss_curve,
        },
        "load": {"lora": quantiles(lora_loads), "delta": quantiles(delta_loads)},
        "switch": {"by_deltas_registered": switch_at, "batch_scope": batch_scope},
        "mixed_batch": {
            "tree_sizes": [int(t.numel()) for t in trees],
            "median_seconds": medians,
            "ratio_round": medians["mixed"]["round"] / medians["single"]["round"],
            "ratio_verify": medians["mixed"]["verify"] / medians["single"]["verify"],
            "seconds": timings,
        },
        "exactness": exactness,
    }


# -- report -------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    memory, load, switch = results["memory"], results["load"], results["switch"]
    mixed, machine = results["mixed_batch"], results["machine"]
    n = results["settings"]["num_adapters"]
    last = switch["by_deltas_registered"][str(n)]
    mib = 2**20
    lines = [
        f"# {n} adapters with draft deltas",
        "",
        f"{machine['model']}, {machine['dtype']}, {machine['threads']} thread(s); "
        f"{machine['cpu']} ({' '.join(machine['flags'])}); `{machine['command']}`",
        "",
        "| what | measured | goal |",
        "|---|---|---|",
        f"| adapters registered (with deltas) | {results['registered']} "
        f"({memory['deltas_registered']} deltas) | {n} |",
        f"| draft deltas in memory | {memory['delta_bank_bytes'] / mib:.0f} MiB in the bank, RSS "
        f"+{memory['delta_rss_growth_bytes'] / mib:.0f} MiB "
        f"({memory['delta_bytes_per_adapter'] / 1024:.0f} KiB each, "
        f"{100 * memory['delta_fraction_of_heads']:.1f} % of the heads) | < 1 GB |",
        f"| LoRA weights resident | {memory['lora_resident']} of {n} "
        f"(LRU, max_resident {results['settings']['max_resident']}): "
        f"{memory['lora_bank_bytes'] / mib:.0f} MiB, RSS "
        f"+{memory['lora_rss_growth_bytes'] / mib:.0f} MiB "
        f"({memory['lora_bytes_per_adapter'] / mib:.1f} MiB each) | |",
        f"| registration (startup scan) | {results['register_seconds']:.2f} s "
        f"({1e3 * results['register_seconds'] / n:.2f} ms per adapter) | |",
        f"| LoRA load from disk (evicting LRU) | median {load['lora']['median_ms']:.1f} ms, "
        f"p95 {load['lora']['p95_ms']:.1f} ms | |",
        f"| delta load (first request) | median {load['delta']['median_ms']:.1f} ms, "
        f"p95 {load['delta']['p95_ms']:.1f} ms | |",
        f"| switch between resident adapters (step scope) | median "
        f"{last['median_ms'] * 1e3:.1f} us, p99 {last['p99_ms'] * 1e3:.1f} us | <= 1 ms |",
        f"| mixed-batch scope ({results['settings']['batch']} rows) | median "
        f"{switch['batch_scope']['median_ms'] * 1e3:.1f} us, p99 "
        f"{switch['batch_scope']['p99_ms'] * 1e3:.1f} us | |",
        f"| mixed batch / one adapter, engine round of {results['settings']['batch']} rows "
        f"(draft + one verify forward) | {mixed['ratio_round']:.3f} "
        f"(verify forward alone {mixed['ratio_verify']:.3f}) | <= 1.15 |",
        f"| rows equal to the request alone (tree; logits) | "
        f"{results['exactness']['trees_equal']}/{results['exactness']['rows']} trees; max "
        f"|diff| {results['exactness']['max_logit_diff']:.1e} (another adapter on the same "
        f"prompt: >= {results['exactness']['min_logit_diff_across_adapters']:.1e}) | all |",
        "",
        "Switch median by deltas registered: "
        + ", ".join(
            f"{count}: {q['median_ms'] * 1e3:.1f} us"
            for count, q in switch["by_deltas_registered"].items()
        ),
        "",
        "Round medians (ms): "
        + "; ".join(
            f"{variant}: draft {1e3 * m['draft']:.1f}, verify {1e3 * m['verify']:.1f}"
            for variant, m in mixed["median_seconds"].items()
        ),
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from selfspec.atomic import write_file_atomic

    memory, switch = results["memory"], results["switch"]["by_deltas_registered"]
    figure, (rss_axis, switch_axis) = plt.subplots(1, 2, figsize=(10, 4))
    counts = [count for count, _ in memory["rss_by_deltas"]]
    base = memory["rss_bytes"]["loras"]
    rss_axis.plot(counts, [(b - base) / 2**20 for _, b in memory["rss_by_deltas"]], "o-")
    rss_axis.set(xlabel="adapters with a delta registered", ylabel="RSS growth (MiB)",
                 title="draft deltas: memory")  # fmt: skip
    keys = list(switch)
    switch_axis.plot([int(k) for k in keys], [switch[k]["median_ms"] * 1e3 for k in keys], "o-",
                     label="median")  # fmt: skip
    switch_axis.plot([int(k) for k in keys], [switch[k]["p99_ms"] * 1e3 for k in keys], "s--",
                     label="p99")  # fmt: skip
    switch_axis.set(xscale="log", xlabel="adapters with a delta registered", ylabel="us",
                    title="switch between resident adapters")  # fmt: skip
    switch_axis.set_ylim(bottom=0)
    switch_axis.legend()
    figure.tight_layout()
    write_file_atomic(path, lambda temporary: figure.savefig(temporary, format="png"))
    plt.close(figure)
    return path


@contextlib.contextmanager
def adapters_root(given: Path | None) -> Iterator[Path]:
    """`given` (kept, reused by later runs), or a temporary directory removed afterwards."""
    if given is not None:
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="selfspec-many-adapters-") as directory:
        yield Path(directory)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--heads", default="eagle", help="'eagle', 'medusa' or a heads dir")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-adapters", type=int, default=1000)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--delta-rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-resident", type=int, default=StoreConfig().max_resident)
    parser.add_argument("--switch-repeats", type=int, default=2000)
    parser.add_argument("--round-repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--adapters-dir",
        type=Path,
        default=None,
        help="where the synthetic adapters go (kept and reused); default: a temporary directory",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/many_adapters"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = {
        "cpu": cpu_model(),
        "flags": cpu_flags(),
        "threads": args.threads,
        "dtype": args.dtype,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "command": " ".join(["python", "benchmarks/many_adapters.py", *sys.argv[1:]]),
    }
    print(f"CPU: {machine['cpu']}; flags: {' '.join(machine['flags'])}; "
          f"{args.threads} thread(s); {args.dtype}", flush=True)  # fmt: skip
    from selfspec.heads import load_heads
    from selfspec.shipped import resolve_heads_dir
    from selfspec.target import TargetSpec, apply_chat_template, load_target

    target = load_target(TargetSpec(model=args.model, dtype=args.dtype, threads=args.threads))
    is_default = args.model in (None, "default")
    heads = load_heads(resolve_heads_dir(args.heads, is_default), target.model)
    machine["model"] = target.name
    prompts = [
        apply_chat_template(target.tokenizer, [{"role": "user", "content": text}])
        for text in PROMPTS
    ]
    settings = Settings(
        Synthesis(args.num_adapters, args.rank, args.delta_rank, args.seed),
        batch=args.batch,
        max_resident=args.max_resident,
        switch_repeats=args.switch_repeats,
        round_repeats=args.round_repeats,
    )
    with adapters_root(args.adapters_dir) as root:
        results = run(
            target.model, heads, target.tokenizer, target.name, prompts, root, settings,
            log=lambda line: print(line, flush=True),
        )  # fmt: skip
    results["machine"] = machine
    print(write_report(results, args.out))
    return 0


def write_report(results: dict, out: Path) -> str:
    """`results.json`, `results.md` and the plot under `out`; returns the Markdown."""
    results = json.loads(json.dumps(results))  # int keys become strings, as in the file
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(results, indent=2))
    report = markdown(results)
    write_text_atomic(out / "results.md", report)
    plot(results, out / "many_adapters.png")
    return report


if __name__ == "__main__":
    sys.exit(main())
