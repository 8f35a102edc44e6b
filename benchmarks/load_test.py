"""Load test of `selfspec serve`: concurrent streaming clients, speculation x batching, one process.

Starts the server in this process on 127.0.0.1 (a free port) with the embedded default model, the
shipped EAGLE heads, the shipped example adapters and the default tree (`auto`: adaptive, sized
from this machine's cost curve). Then, for each cell of the matrix (`--batching`: those rows only)

    speculation on / off  (the request field "speculation": false = vanilla decoding)
  x batching              one-forward: max_running = clients, the running requests' trees
                          verified in ONE target forward (mixed adapters, ragged trees
                          back to back on the kernels);
                          interleaved: max_running = clients, one forward per request;
                          off: max_running = 1, one request at a time

N client threads send greedy streaming chat completions (a random held-out prompt on a random
served model, the base included) for T seconds or until `--max-requests`, and the cell reports
requests/s, output tokens/s, TTFT p50/p99 (to the first content chunk), TPOT p50/p99 (time per
output token after the first), τ, and errors by status. Afterwards every distinct (model,
prompt) sent is run again alone on the idle server, one at a time, with speculation off: the
`equal` column counts the greedy outputs that equal that serial vanilla reference, which checks
both that concurrency does not change a request's output and that speculation is lossless.
Before its two cells each server answers every (model, prompt) once, unmeasured (`warm_up`), so
the cell that runs first does not pay the prefills that the prefix cache then saves the other;
then the two cells run in `--phases` alternating phases (on, off, off, on, ...), so that drift
over the run falls on both alike.

    .venv/bin/python benchmarks/load_test.py --clients 4 --duration 30 --out runs/load_test

The clients share the process (and the GIL) with the server; on a small shared CPU box the
absolute numbers are noisy, the side-by-side ratios less so. Timings are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
from tqdm import tqdm

from selfspec.modes import ACTIVATION_NAMES
from selfspec.reports import machine_record, percentile, write_report
from selfspec.serve.background import running_server
from selfspec.serve.cli import ServeArgs, build_state
from selfspec.serve.metrics import ServerMetrics
from selfspec.target import DTYPES

BATCHING = ("one-forward", "interleaved", "off")
HELDOUT = Path(__file__).resolve().parents[1] / "train" / "data" / "prompts_heldout.jsonl"
REQUEST_TIMEOUT_S = 600.0
WARM_UP_TOKENS = 8


@dataclass(frozen=True)
class LoadConfig:
    clients: int = 4
    """Concurrent clients; also the engine's max_running when batching."""
    duration: float = 30.0
    """Seconds each cell keeps starting requests (in-flight ones then finish)."""
    max_requests: int | None = None
    """Per cell, over all clients: stop starting requests after this many (None: no bound)."""
    max_tokens: int = 48
    num_prompts: int = 4
    """The first held-out prompts used: fewer distinct requests keep the serial check short."""
    threads: int = 1
    """torch CPU threads."""
    dtype: str = "float32"
    """The served target's dtype: "float32" or "bfloat16" (packed weights)."""
    activations: str = "auto"
    """float32 from the GGUF file's blocks: "auto", "float" or "int24" (`serve --activations`)."""
    seed: int = 0
    """Seeds the clients' choice of model and prompt."""
    temperature: float = 0.0
    """0: greedy, every output checked against serial vanilla decoding; > 0: unseeded sampling
    (lossless in distribution, so no output is checked)."""
    phases: int = 2
    """Each cell's duration (and request bound) is split into this many phases, the on and
    off cells of a server alternating as on, off, off, on, ... so that drift over the run
    (warming caches, a neighbour's load) falls on both alike."""

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError(f"--clients must be >= 1, got {self.clients}")
        if not self.duration > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.phases < 1:
            raise ValueError(f"--phases must be >= 1, got {self.phases}")

    def phase(self) -> LoadConfig:
        """One phase of a cell: its share of the duration and of the request bound."""
        share = None if self.max_requests is None else -(-self.max_requests // self.phases)
        return replace(self, duration=self.duration / self.phases, max_requests=share)


@dataclass
class Sample:
    """One request as its client saw it."""

    model: str
    prompt: int
    """Index into the prompt list."""
    status: str
    """"200", another HTTP status, "stream-error", or an exception's type name."""
    seconds: float = 0.0
    ttft: float | None = None
    tokens: int = 0
    tau: float | None = None
    text: str = ""


@dataclass
class Cell:
    speculation: bool
    batching: str
    """one-forward, interleaved or off (BATCHING)."""
    max_running: int
    samples: list[Sample] = field(default_factory=list)
    wall_seconds: float = 0.0


def stream_chat(client: httpx.Client, url: str, body: dict[str, object]) -> Sample:
    sample = Sample(model=str(body["model"]), prompt=-1, status="200")
    start = time.perf_counter()
    pieces: list[str] = []
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                sample.status = str(response.status_code)
                return sample
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    sample.status = "stream-error"
                    continue
                for choice in chunk.get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        if sample.ttft is None:
                            sample.ttft = time.perf_counter() - start
                        pieces.append(content)
                if chunk.get("usage"):
                    sample.tokens = chunk["usage"]["completion_tokens"]
                if "selfspec" in chunk:
                    sample.tau = chunk["selfspec"]["tau"]
    except httpx.HTTPError as error:
        sample.status = type(error).__name__
    sample.seconds = time.perf_counter() - start
    sample.text = "".join(pieces)
    return sample


def request_body(model: str, prompt: str, config: LoadConfig, speculation: bool) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculation": speculation,
    }


def run_cell(
    url: str,
    cell: Cell,
    config: LoadConfig,
    models: list[str],
    prompts: list[str],
    phase: int = 0,
) -> None:
    """N clients, each a thread sending one request after another until the deadline; the
    samples and the wall time add to ``cell``'s."""
    lock = threading.Lock()
    started = [0]
    deadline = time.monotonic() + config.duration
    name = f"speculation {_on(cell.speculation)}, batching {cell.batching}, phase {phase + 1}"
    bar = tqdm(total=config.max_requests, desc=name, unit="req", leave=False)

    def client(index: int) -> None:
        rng = random.Random(f"{config.seed}:{index}:{phase}")
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
            while time.monotonic() < deadline:
                with lock:
                    if config.max_requests is not None and started[0] >= config.max_requests:
                        return
                    started[0] += 1
                model = rng.choice(models)
                prompt = rng.randrange(len(prompts))
                body = request_body(model, prompts[prompt], config, cell.speculation)
                sample = stream_chat(http, url, body)
                sample.prompt = prompt
                with lock:
                    cell.samples.append(sample)
                    bar.update(1)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(config.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cell.wall_seconds += time.perf_counter() - start
    bar.close()


def warm_up(url: str, config: LoadConfig, models: list[str], prompts: list[str]) -> None:
    """Every (model, prompt) once, one at a time, a few tokens with speculation on, not
    measured: both cells of a server then meet the same warm prefix cache (the first cell
    otherwise pays every prompt's prefill and the second none)."""
    short = replace(config, max_tokens=WARM_UP_TOKENS)
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        for model in models:
            for prompt in prompts:
                sample = stream_chat(http, url, request_body(model, prompt, short, True))
                if sample.status != "200":
                    raise RuntimeError(f"the warm-up request on {model} failed: {sample.status}")


def serial_references(
    url: str, cells: list[Cell], config: LoadConfig, prompts: list[str]
) -> dict[tuple[str, int], str]:
    """Each distinct (model, prompt) alone on the idle server, speculation off."""
    sent = [s for cell in cells for s in cell.samples if s.status == "200"]
    keys = sorted({(s.model, s.prompt) for s in sent})
    references = {}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        for model, prompt in tqdm(keys, desc="serial vanilla references", unit="req", leave=False):
            body = request_body(model, prompts[prompt], config, speculation=False)
            sample = stream_chat(http, url, body)
            if sample.status != "200":
                raise RuntimeError(f"the reference run of {model} / prompt {prompt} failed")
            references[(model, prompt)] = sample.text
    return references


def _equal(row: dict[str, object]) -> str:
    """``equal/requests``, or n/a where outputs were sampled and not checked."""
    equal = row["equal_to_serial_vanilla"]
    return "n/a (sampled)" if equal is None else f"{equal}/{row['requests']}"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def summarize(cell: Cell, references: dict[tuple[str, int], str]) -> dict[str, object]:
    ok = [s for s in cell.samples if s.status == "200"]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    tpots = [(s.seconds - s.ttft) / (s.tokens - 1) for s in ok if s.ttft and s.tokens > 1]
    taus = [s.tau for s in ok if s.tau is not None]
    tokens = sum(s.tokens for s in ok)
    wall = cell.wall_seconds
    return {
        "speculation": cell.speculation,
        "batching": cell.batching,
        "max_running": cell.max_running,
        "requests": len(ok),
        "wall_seconds": round(wall, 2),
        "requests_per_second": round(len(ok) / wall, 3) if wall else None,
        "output_tokens": tokens,
        "output_tokens_per_second": round(tokens / wall, 2) if wall else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "mean_tau": round(sum(taus) / len(taus), 3) if taus else None,
        "errors": dict(Counter(s.status for s in cell.samples if s.status != "200")),
        "equal_to_serial_vanilla": (
            sum(s.text == references[(s.model, s.prompt)] for s in ok) if references else None
        ),
    }


def markdown(rows: list[dict[str, object]]) -> str:
    def ms(value: object) -> str:
        return "–" if value is None else f"{1000 * value:.0f}"

    lines = [
        "| speculation | batching (max_running) | requests | req/s | out tok/s | TTFT p50 ms "
        "| TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | τ | errors | greedy = serial vanilla |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(row["errors"].items())) or "0"
        lines.append(
            f"| {_on(row['speculation'])} | {row['batching']} ({row['max_running']}) "
            f"| {row['requests']} | {row['requests_per_second']:.2f} "
            f"| {row['output_tokens_per_second']:.1f} "
            f"| {ms(row['ttft_p50_s'])} | {ms(row['ttft_p99_s'])} "
            f"| {ms(row['tpot_p50_s'])} | {ms(row['tpot_p99_s'])} "
            f"| {row['mean_tau'] if row['mean_tau'] is not None else '–'} | {errors} "
            f"| {_equal(row)} |"
        )
    return "\n".join(lines) + "\n"


def load_prompts(path: Path, count: int) -> list[str]:
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line]
    if len(prompts) < count:
        raise ValueError(f"{path} has {len(prompts)} prompts, --num-prompts asks for {count}")
    return prompts[:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (N)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per cell (T)")
    parser.add_argument("--max-requests", type=int, default=None, help="per cell, all clients")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-prompts", type=int, default=4, help="first held-out prompts used")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--activations", choices=ACTIVATION_NAMES, default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (outputs checked); > 0: sampled"
    )
    parser.add_argument(
        "--phases", type=int, default=2, help="phases per cell, on and off alternating (ABBA)"
    )
    parser.add_argument(
        "--batching",
        nargs="+",
        choices=BATCHING,
        default=list(BATCHING),
        help="which batching cells to run (each with speculation on and off)",
    )
    parser.add_argument("--prompts", type=Path, default=HELDOUT)
    parser.add_argument("--out", type=Path, default=Path("runs/load_test"))
    args = parser.parse_args(argv)
    try:
        config = LoadConfig(
            clients=args.clients,
            duration=args.duration,
            max_requests=args.max_requests,
            max_tokens=args.max_tokens,
            num_prompts=args.num_prompts,
            threads=args.threads,
            dtype=args.dtype,
            activations=args.activations,
            seed=args.seed,
            phases=args.phases,
            temperature=args.temperature,
        )
        prompts = load_prompts(args.prompts, config.num_prompts)
    except (OSError, ValueError) as error:
        print(f"load_test: error: {error}", file=sys.stderr)
        return 2

    # Default heads, shipped example adapters, default tree; queue room for every client.
    base = build_state(
        ServeArgs(
            threads=config.threads,
            max_queue=config.clients,
            dtype=config.dtype,
            activations=config.activations,
        )
    )
    models = [base.model_name, *sorted(base.served)]
    print(f"serving {base.model_name} with adapters {', '.join(models[1:])}; ", end="")
    print(f"{config.clients} clients, {config.duration:g} s per cell", flush=True)
    cells: list[Cell] = []
    references: dict[tuple[str, int], str] = {}
    batchings = [b for b in BATCHING if b in args.batching]
    for batching in batchings:
        max_running = 1 if batching == "off" else config.clients
        state = replace(
            base,
            max_running=max_running,
            batch_verify=batching == "one-forward",
            metrics=ServerMetrics(),
        )
        pair = {on: Cell(on, batching, max_running) for on in (True, False)}
        with running_server(state) as (url, _):
            warm_up(url, config, models, prompts)
            for phase in range(config.phases):
                for speculation in (True, False) if phase % 2 == 0 else (False, True):
                    run_cell(url, pair[speculation], config.phase(), models, prompts, phase)
            cells += [pair[True], pair[False]]
            if batching == batchings[-1] and config.temperature == 0:  # the last, now idle
                references = serial_references(url, cells, config, prompts)

    rows = [summarize(cell, references) for cell in cells]
    table = markdown(rows)
    report = {
        "config": {**asdict(config), "batching": batchings},
        "models": models,
        "tree": "auto (adaptive, this machine's cost curve)",
        "machine": {"platform": platform.platform(), **machine_record()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cells": rows,
        "requests": [
            {"cell": i, **{k: v for k, v in asdict(s).items() if k != "text"}}
            for i, cell in enumerate(cells)
            for s in cell.samples
        ],
    }
    machine = report["machine"]
    print(f"{machine['cpu']} (flags: {' '.join(machine['flags'])}), {config.threads} torch threads")
    write_report(args.out, report, table, stem="load_test")
    print(f"wrote {args.out / 'load_test.json'} and {args.out / 'load_test.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
