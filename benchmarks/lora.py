"""Multi-LoRA speed, side by side in one run: peft's LoRA layers vs the fast path (`fast_lora`).

On the embedded default model (SmolLM2-135M-Instruct) with the example adapters and synthesized
r=16 adapters on all seven linear layers of every block, it measures, as medians of `--repeats`
rounds after warmup (every variant once per round, interleaved, so load on the shared machine hits
all of them alike):

- forward cost with one resident adapter active / the bare base, at 1 token and at a 64-token
  tree forward (a chain as the tree: a 4D float mask over cache + tree, per-node positions);
- a batch of 4 requests on 4 different adapters / the same batch all on one adapter (1 token each);
- switch latency between two requests on different resident adapters (entering a step scope);
- load-from-disk latency of one adapter;
- merging one adapter into the base weights and back (what a "merge when one adapter owns the
  batch" policy would pay per switch);
- 100 adapters behind one base with `max_resident` respected: RSS growth, and a short greedy
  generation per adapter on the fast path compared with peft's, token for token.

Prints a Markdown table and writes JSON (`--out`). Timings are ratios measured side by side, never
asserts. Example: `python benchmarks/lora.py --threads 1 --out runs/lora_bench.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import DynamicCache

from selfspec.adapters.store import AdapterStore, LoraBackend, StoreConfig
from selfspec.atomic import write_text_atomic
from selfspec.reports import rss_bytes
from selfspec.target import TargetSpec, load_target

EXAMPLES = Path(__file__).resolve().parents[1] / "adapters" / "examples"
EXAMPLE_NAMES = ("code", "docs", "persona", "shout")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CACHE_TOKENS = 32
TREE_TOKENS = 64


def synthesize_adapter(model: torch.nn.Module, path: Path, seed: int, rank: int = 16) -> Path:
    """A peft LoRA directory with random r=`rank` weights on all seven linear layers of every
    block (bf16 on disk, like the examples); B is scaled so the adapter moves the output a bit."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ALL_LINEAR:
            fan_out, fan_in = module.weight.shape
            lora_a = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5  # [r, in]
            lora_b = torch.randn(fan_out, rank, generator=generator) * 0.01  # [out, r]
            state[f"base_model.model.{name}.lora_A.weight"] = lora_a.to(torch.bfloat16)
            state[f"base_model.model.{name}.lora_B.weight"] = lora_b.to(torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(ALL_LINEAR))
    config.save_pretrained(str(path))
    save_file(state, str(path / "adapter_model.safetensors"))
    return path


def prefilled(model: torch.nn.Module, batch: int) -> tuple[DynamicCache, int]:
    """A cache holding `CACHE_TOKENS` prompt tokens per row (the state a decode step starts
    from), and its length."""
    ids = torch.arange(10, 10 + CACHE_TOKENS).repeat(batch, 1)  # [batch, cache]
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache, CACHE_TOKENS


def decode_forward(model: torch.nn.Module, batch: int) -> Callable[[], None]:
    """One 1-token forward per row over the prefilled cache; the cache is cropped back after."""
    cache, length = prefilled(model, batch)
    ids = torch.full((batch, 1), 42)  # [batch, 1]

    def run() -> None:
        model(input_ids=ids, cache=cache, use_cache=True)
        cache.crop(-1)  # negative: drop the step's entry again

    return run


def tree_forward(model: torch.nn.Module) -> Callable[[], None]:
    """One forward of a `TREE_TOKENS`-node tree (a chain) with a 4D float mask, per-node
    positions, over the prefilled cache: the shape of a speculative verification step."""
    cache, length = prefilled(model, 1)
    ids = torch.arange(200, 200 + TREE_TOKENS)[None]  # [1, tree]
    allowed = torch.ones(TREE_TOKENS, length + TREE_TOKENS, dtype=torch.bool)
    allowed[:, length:] = torch.tril(allowed[:, length:])
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    mask = mask[None, None]  # [1, 1, tree, cache + tree]
    positions = torch.arange(length, length + TREE_TOKENS)[None]  # [1, tree]

    def run() -> None:
        model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
        )
        cache.crop(-TREE_TOKENS)

    return run


def measure(
    variants: dict[str, Callable[[], None]],
    ratios: Sequence[tuple[str, str]],
    repeats: int,
    warmup: int,
    desc: str,
) -> dict[str, dict[str, float]]:
    """Median seconds of each variant, and for each (numerator, denominator) pair of `ratios`
    the median of the per-round ratios. Every round runs every variant once (interleaved), and
    pairing within a round cancels most of the drift of a shared machine's load."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        names = list(variants)
        for round_ in tqdm(range(warmup + repeats), desc=desc, leave=False):
            # Rotated start: no variant always runs first (or right after the same neighbour).
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                run = variants[name]
                start = time.perf_counter()
                run()
                elapsed = time.perf_counter() - start
                if round_ >= warmup:
                    times[name].append(elapsed)
    return {
        "median_s": {name: statistics.median(values) for name, values in times.items()},
        "ratio": {
            f"{num} / {den}": statistics.median(
                a / b for a, b in zip(times[num], times[den], strict=True)
            )
            for num, den in ratios
        },
    }


def under(scope_factory: Callable[[], contextlib.AbstractContextManager], run: Callable[[], None]):
    def scoped() -> None:
        with scope_factory():
            run()

    return scoped


def greedy(model, store: AdapterStore, name: str, prompt: Sequence[int], steps: int) -> list[int]:
    """Greedy tokens under `name`, one step scope per forward (as the generator does)."""
    cache, ids, out = DynamicCache(), torch.tensor([list(prompt)]), []
    step = store.scope(name)
    with torch.inference_mode():
        for _ in range(steps):
            with step():
                logits = model(input_ids=ids, cache=cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def switch_latency(store: AdapterStore, a: str, b: str, repeats: int) -> float:
    """Median seconds to enter (and leave) a step scope on the other of two resident adapters."""
    scopes = [store.scope(a), store.scope(b)]
    times = []
    for i in range(2 * repeats + 2):
        start = time.perf_counter()
        with scopes[i % 2]():
            pass
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_latency(store: AdapterStore, name: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        store.unload(name)
        start = time.perf_counter()
        store.load(name)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def merge_cost(model: torch.nn.Module, adapter: Path, repeats: int) -> dict[str, float]:
    """Seconds to merge one adapter into the base weights (W += s B A) and to unmerge it again,
    and the largest drift the round trip leaves in the base weights (merging is not exact)."""
    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    state = load_file(str(adapter / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    pairs = []
    for key in state:
        if key.endswith(".lora_A.weight"):
            name = key[len("base_model.model.") : -len(".lora_A.weight")]
            lora_a = state[key].float()  # [r, in]
            lora_b = state[key.replace("lora_A", "lora_B")].float() * scale  # [out, r]
            pairs.append((modules[name].weight, lora_a, lora_b))
    originals = [weight.clone() for weight, _, _ in pairs]
    merge, unmerge = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for weight, lora_a, lora_b in pairs:
            weight.addmm_(lora_b, lora_a)
        merge.append(time.perf_counter() - start)
        start = time.perf_counter()
        for weight, lora_a, lora_b in pairs:
            weight.addmm_(lora_b, lora_a, alpha=-1)
        unmerge.append(time.perf_counter() - start)
    drift = max(float((w - o).abs().max()) for (w, _, _), o in zip(pairs, originals, strict=True))
    for (weight, _, _), original in zip(pairs, originals, strict=True):
        weight.copy_(original)
    return {
        "merge_s": statistics.median(merge),
        "unmerge_s": statistics.median(unmerge),
        "round_trip_max_drift": drift,
    }


def hundred_adapters(
    base: torch.nn.Module,
    dirs: dict[str, Path],
    backend: LoraBackend,
    max_resident: int,
    steps: int,
) -> dict:
    """Serve one short greedy request per adapter, round robin over all of them."""
    gc.collect()  # the previous phase's model and store
    model = copy.deepcopy(base)
    before = rss_bytes()
    store = AdapterStore(
        model, adapters=dirs, config=StoreConfig(max_resident=max_resident, backend=backend)
    )
    outputs, most_resident, peak, lora_bytes = {}, 0, before, 0
    start = time.perf_counter()
    for name in tqdm(dirs, desc=f"100 adapters ({backend.value})", leave=False):
        outputs[name] = greedy(model, store, name, [1, 504, 3510, 28, 253, 3024], steps)
        most_resident = max(most_resident, len(store.resident()))
        lora_bytes = max(lora_bytes, store.lora_bytes)
        peak = max(peak, rss_bytes())
    elapsed = time.perf_counter() - start
    return {
        "outputs": outputs,
        "seconds": elapsed,
        "most_resident": most_resident,
        "rss_growth_bytes": peak - before,
        "lora_bytes": lora_bytes,
        "fallbacks": store.fallbacks,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds per measurement")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--adapters", type=int, default=100, help="adapters behind one base")
    parser.add_argument("--max-resident", type=int, default=8)
    parser.add_argument("--gen-tokens", type=int, default=3, help="greedy tokens per adapter")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(TargetSpec())
    # The measured models are all deep copies, allocated alike (the loaded model itself is not
    # measured: its weights lie differently in memory and ran measurably slower than a copy).
    bare, model_name = copy.deepcopy(target.model), target.name
    del target
    results: dict = {
        "model": model_name,
        "dtype": str(next(bare.parameters()).dtype),
        "threads": args.threads,
        "repeats": args.repeats,
        "cpu": os.uname().machine,
    }
    with tempfile.TemporaryDirectory(prefix="selfspec-lora-bench-") as tmp:
        synth = {f"r16_{i:03d}": Path(tmp) / f"r16_{i:03d}" for i in range(args.adapters)}
        for index, path in enumerate(tqdm(synth.values(), desc="synthesize", leave=False)):
            synthesize_adapter(bare, path, seed=index)
        dirs = {name: EXAMPLES / name for name in EXAMPLE_NAMES}
        dirs["r16"] = synth["r16_000"]
        stores = {}
        for backend in (LoraBackend.PEFT, LoraBackend.FAST):
            model = copy.deepcopy(bare)
            store = AdapterStore(model, adapters=dirs, config=StoreConfig(backend=backend))
            for name in dirs:
                store.load(name)
            stores[backend.value] = store

        # Forward cost: 1 token and a 64-node tree, one adapter active, vs the bare base.
        for label, make in (("1 token", lambda m: decode_forward(m, 1)), ("tree 64", tree_forward)):
            variants, ratios = {"bare": make(bare)}, []
            adapters = ("base", "r16", "code") if label == "1 token" else ("base", "r16")
            for path, store in stores.items():
                run = make(store.base_model)
                for adapter in adapters:
                    scope = store.scope(None if adapter == "base" else adapter)
                    variants[f"{path} {adapter}"] = under(scope, run)
                    ratios.append((f"{path} {adapter}", "bare"))
            results[f"forward {label}"] = measure(
                variants, ratios, args.repeats, args.warmup, label
            )

        # A batch of 4 requests (1 token each) on 4 different adapters vs all on one adapter.
        variants = {"bare": decode_forward(bare, 4)}
        for path, store in stores.items():
            run = decode_forward(store.base_model, 4)
            variants[f"{path} 4 adapters"] = under(
                lambda s=store: s.batch_scope(list(EXAMPLE_NAMES)), run
            )
            # peft's best for one adapter is its plain active adapter, not `adapter_names`.
            one = store.scope("code") if path == "peft" else None
            variants[f"{path} 1 adapter"] = under(
                one or (lambda s=store: s.batch_scope(["code"] * 4)), run
            )
        ratios = [(f"{p} 4 adapters", f"{p} 1 adapter") for p in stores]
        ratios += [(f"{p} 4 adapters", "bare") for p in stores]
        results["batch of 4"] = measure(variants, ratios, args.repeats, args.warmup, "batch of 4")

        results["switch"] = {p: switch_latency(s, "code", "shout", 100) for p, s in stores.items()}
        results["load"] = {p: load_latency(s, "persona", 5) for p, s in stores.items()}
        results["merge r16"] = merge_cost(copy.deepcopy(bare), dirs["r16"], 5)
        stores.clear()

        served = {
            backend.value: hundred_adapters(
                bare, synth, backend, args.max_resident, args.gen_tokens
            )
            for backend in (LoraBackend.FAST, LoraBackend.PEFT)
        }
        same = sum(served["fast"]["outputs"][n] == served["peft"]["outputs"][n] for n in synth)
        results["100 adapters"] = {
            "adapters": len(synth),
            "max_resident": args.max_resident,
            "same_greedy_tokens": same,
            "distinct_outputs": len({tuple(v) for v in served["fast"]["outputs"].values()}),
            **{p: {k: v for k, v in r.items() if k != "outputs"} for p, r in served.items()},
        }
    print(markdown(results))
    if args.out is not None:
        write_text_atomic(args.out, json.dumps(results, indent=2) + "\n")
    return 0


def markdown(results: dict) -> str:
    ms = 1e3
    rows = [
        "| measurement (medians; ratios paired per round) | peft | fast | target |",
        "|---|---|---|---|",
    ]
    for label, key in (("1 token", "forward 1 token"), ("64-token tree", "forward tree 64")):
        bare, ratio = results[key]["median_s"]["bare"], results[key]["ratio"]
        rows.append(f"| forward, {label}: bare base | {bare * ms:.1f} ms | {bare * ms:.1f} ms | |")
        adapters = [("r16", "r=16 on all 7 linear of every block", "<= 1.10x")]
        if "fast code / bare" in ratio:
            adapters.append(("code", "example `code` (r=8, 12 blocks)", ""))
        adapters.append(("base", "no adapter, through the store", ""))
        for adapter, what, target in adapters:
            rows.append(
                f"| forward, {label}, {what} / bare | {ratio[f'peft {adapter} / bare']:.3f}x | "
                f"{ratio[f'fast {adapter} / bare']:.3f}x | {target} |"
            )
    batch = results["batch of 4"]["ratio"]
    rows.append(
        f"| batch of 4 (1 token each), 4 example adapters / all on `code` | "
        f"{batch['peft 4 adapters / peft 1 adapter']:.3f}x | "
        f"{batch['fast 4 adapters / fast 1 adapter']:.3f}x | <= 1.15x |"
    )
    rows.append(
        f"| batch of 4, 4 example adapters / bare | {batch['peft 4 adapters / bare']:.3f}x | "
        f"{batch['fast 4 adapters / bare']:.3f}x | |"
    )
    switch, load = results["switch"], results["load"]
    rows.append(
        f"| switch between two resident adapters | {switch['peft'] * ms:.3f} ms | "
        f"{switch['fast'] * ms:.3f} ms | <= 1 ms |"
    )
    rows.append(
        f"| load one example adapter from disk | {load['peft'] * ms:.1f} ms | "
        f"{load['fast'] * ms:.1f} ms | |"
    )
    hundred = results["100 adapters"]
    rows.append(
        f"| {hundred['adapters']} r=16 adapters, max_resident={hundred['max_resident']}: most "
        f"resident | {hundred['peft']['most_resident']} | {hundred['fast']['most_resident']} | |"
    )
    rows.append(
        f"| ... LoRA weights held (most) | {hundred['peft']['lora_bytes'] / 2**20:.0f} MiB | "
        f"{hundred['fast']['lora_bytes'] / 2**20:.0f} MiB | |"
    )
    rows.append(
        f"| ... peak RSS growth serving all of them | "
        f"{hundred['peft']['rss_growth_bytes'] / 2**20:.0f} MiB | "
        f"{hundred['fast']['rss_growth_bytes'] / 2**20:.0f} MiB | |"
    )
    rows.append(
        f"| ... time for one short greedy request each | {hundred['peft']['seconds']:.1f} s | "
        f"{hundred['fast']['seconds']:.1f} s | |"
    )
    rows.append(
        f"| ... greedy tokens equal to peft's | | {hundred['same_greedy_tokens']}/"
        f"{hundred['adapters']} | all |"
    )
    merge = results["merge r16"]
    rows.append(
        f"| merge / unmerge one r=16 adapter into the base (not shipped) | "
        f"{merge['merge_s'] * ms:.0f} / {merge['unmerge_s'] * ms:.0f} ms | "
        f"round-trip drift {merge['round_trip_max_drift']:.1e} | |"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
