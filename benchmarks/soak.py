"""Soak test of `selfspec serve`: a long bounded loop of concurrent clients against one server
process, watching its resident memory, its errors and its latency.

Starts `selfspec serve` as its own process on 127.0.0.1 (a free port; the embedded default model,
the shipped EAGLE heads and example adapters, speculation on, as the quick start runs it), then
`--clients` threads send requests until `--duration` seconds have passed: chat and text
completions, streamed and not, greedy and sampled, each on the next served model in turn (the
base and every adapter). A sampler reads the server's resident set (`VmRSS` of its process)
every `--sample-every` seconds. The report gives, after `--warmup` seconds:

- the RSS at the end of warm-up, its minimum, maximum and last value, and the largest deviation
  from the warm-up value in % (the soak goal: within ±5 %);
- requests, errors by status (any non-200, a broken stream, a timeout), output tokens/s;
- latency p50 / p95 / p99 of whole requests (seconds), and of the first streamed token.

    .venv/bin/python benchmarks/soak.py --duration 1800 --clients 4 --out runs/soak

Writes soak.json, soak.md and soak.png (RSS and latency over time) into --out. Loopback only;
the clients never leave the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from selfspec.reports import machine_record, percentile, rss_bytes, write_report

HELDOUT = Path(__file__).resolve().parents[1] / "train" / "data" / "prompts_heldout.jsonl"
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class SoakConfig:
    duration: float = 1800.0
    """Seconds the clients keep sending (a request under way then finishes)."""
    clients: int = 4
    warmup: float = 300.0
    """Seconds before the RSS baseline is taken (caches, adapters and cost curves fill: ~3 min
    for the default server with 4 clients)."""
    sample_every: float = 5.0
    max_tokens: int = 64

    def __post_init__(self) -> None:
        if self.duration <= 0 or self.clients < 1 or self.sample_every <= 0:
            raise ValueError("duration and sample_every must be > 0, clients >= 1")
        if not 0 <= self.warmup < self.duration:
            raise ValueError(f"warmup must be in [0, duration), got {self.warmup}")


@dataclass
class Request:
    started: float
    """Seconds since the soak began."""
    model: str
    kind: str
    """"chat" or "completion", then "+stream" when streamed."""
    status: str
    """"200", another status code, "broken-stream" or "timeout"."""
    seconds: float
    first_token_seconds: float | None = None
    tokens: int = 0


@dataclass
class SoakLog:
    requests: list[Request] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the soak began, resident bytes of the server)."""
    lock: threading.Lock = field(default_factory=threading.Lock)


def one_request(client: httpx.Client, model: str, prompt: str, index: int, max_tokens: int):
    """A request of kind ``index``: the kinds cycle through chat / completion x streamed or not
    x greedy / sampled. Returns (kind, status, first token seconds, output tokens)."""
    chat, stream, sampled = index % 2 == 0, (index // 2) % 2 == 0, (index // 4) % 2 == 1
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0.8 if sampled else 0}
    if sampled:
        body["seed"] = index
    if chat:
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:  # a raw prompt often ends at once in an instruct model: run it to max_tokens
        route, body["prompt"], body["ignore_eos"] = "/v1/completions", prompt, True
    kind = ("chat" if chat else "completion") + ("+stream" if stream else "")
    started = time.perf_counter()
    if not stream:
        reply = client.post(route, json=body)
        if reply.status_code != 200:
            return kind, str(reply.status_code), None, 0
        return kind, "200", None, int(reply.json()["usage"]["completion_tokens"])
    body["stream"], body["stream_options"] = True, {"include_usage": True}
    first, tokens, done = None, 0, False
    with client.stream("POST", route, json=body) as reply:
        if reply.status_code != 200:
            reply.read()
            return kind, str(reply.status_code), None, 0
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return kind, "broken-stream", first, tokens
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
    return kind, "200" if done else "broken-stream", first, tokens


def run_clients(
    url: str, models: list[str], prompts: list[str], config: SoakConfig, log: SoakLog, t0: float
) -> None:
    """``config.clients`` threads sending requests until ``config.duration`` has passed."""
    deadline = t0 + config.duration

    def client_loop(number: int) -> None:
        with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
            count = 0  # this client's requests so far: the kind of the next one
            while time.perf_counter() < deadline:
                index = number + count * config.clients  # over all clients: model and prompt
                model = models[index % len(models)]
                prompt = prompts[(index * 7) % len(prompts)]
                started = time.perf_counter()
                try:
                    kind, status, first, tokens = one_request(
                        client, model, prompt, count + number, config.max_tokens
                    )
                except httpx.TimeoutException:
                    kind, status, first, tokens = "?", "timeout", None, 0
                except (httpx.HTTPError, json.JSONDecodeError, KeyError):
                    kind, status, first, tokens = "?", "broken-stream", None, 0
                record = Request(
                    started - t0, model, kind, status, time.perf_counter() - started, first, tokens
                )
                with log.lock:
                    log.requests.append(record)
                count += 1

    threads = [
        threading.Thread(target=client_loop, args=(n,), daemon=True) for n in range(config.clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def sample_rss(pid: int, config: SoakConfig, log: SoakLog, t0: float, stop: threading.Event):
    while not stop.is_set():
        log.rss.append((time.perf_counter() - t0, rss_bytes(pid)))
        stop.wait(config.sample_every)


def soak(url: str, pid: int, models: list[str], prompts: list[str], config: SoakConfig) -> dict:
    """Run the clients against ``url`` while sampling process ``pid``'s RSS; the summary."""
    log, stop = SoakLog(), threading.Event()
    t0 = time.perf_counter()
    sampler = threading.Thread(target=sample_rss, args=(pid, config, log, t0, stop), daemon=True)
    sampler.start()
    try:
        run_clients(url, models, prompts, config, log, t0)
    finally:
        stop.set()
        sampler.join()
    log.rss.append((time.perf_counter() - t0, rss_bytes(pid)))
    return summarize(log, config)


def summarize(log: SoakLog, config: SoakConfig) -> dict:
    """RSS after warm-up against its value at the end of warm-up, errors, latency."""
    after = [(t, b) for t, b in log.rss if t >= config.warmup]
    if not after:
        raise ValueError("no RSS sample after the warm-up: lengthen --duration")
    baseline = after[0][1]
    deviation = max(abs(b - baseline) for _, b in after) / baseline
    measured = [r for r in log.requests if r.started >= config.warmup]
    seconds = [r.seconds for r in measured if r.status == "200"]
    firsts = [r.first_token_seconds for r in measured if r.first_token_seconds is not None]
    span = max((r.started + r.seconds for r in measured), default=0.0) - config.warmup
    statuses = Counter(r.status for r in log.requests)
    return {
        "config": asdict(config),
        "requests": len(log.requests),
        "requests_after_warmup": len(measured),
        "errors": {s: n for s, n in statuses.items() if s != "200"},
        "kinds": dict(Counter(r.kind for r in log.requests)),
        "models": dict(Counter(r.model for r in log.requests)),
        "rss_mb": {
            "warmup_end": baseline / 2**20,
            "min": min(b for _, b in after) / 2**20,
            "max": max(b for _, b in after) / 2**20,
            "last": after[-1][1] / 2**20,
        },
        "rss_max_deviation_pct": 100 * deviation,
        "rss_within_5pct": deviation <= 0.05,
        "latency_s": {q: percentile(seconds, float(q[1:])) for q in ("p50", "p95", "p99")},
        "first_token_s": {q: percentile(firsts, float(q[1:])) for q in ("p50", "p95", "p99")},
        "output_tokens_per_s": sum(r.tokens for r in measured) / span if span > 0 else 0.0,
        "rss_samples": [(round(t, 1), b) for t, b in log.rss],
        "request_log": [asdict(r) for r in log.requests],
    }


def markdown(report: dict) -> str:
    rss, lat, first = report["rss_mb"], report["latency_s"], report["first_token_s"]
    errors = ", ".join(f"{s}: {n}" for s, n in report["errors"].items()) or "none"

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    return "\n".join([
        "| measure | value |",
        "|---|---|",
        f"| duration / warm-up | {report['config']['duration']:.0f} s / "
        f"{report['config']['warmup']:.0f} s, {report['config']['clients']} clients |",
        f"| requests (after warm-up) | {report['requests']} ({report['requests_after_warmup']}) |",
        f"| errors | {errors} |",
        f"| RSS at warm-up end / min / max / last | {rss['warmup_end']:.0f} / {rss['min']:.0f} / "
        f"{rss['max']:.0f} / {rss['last']:.0f} MiB |",
        f"| RSS largest deviation after warm-up | {report['rss_max_deviation_pct']:.2f} % "
        f"({'within' if report['rss_within_5pct'] else 'NOT within'} ±5 %) |",
        f"| latency p50 / p95 / p99 | {fmt(lat['p50'])} / {fmt(lat['p95'])} / "
        f"{fmt(lat['p99'])} s |",
        f"| first streamed token p50 / p95 / p99 | {fmt(first['p50'])} / {fmt(first['p95'])} / "
        f"{fmt(first['p99'])} s |",
        f"| output tokens/s | {report['output_tokens_per_s']:.1f} |",
    ]) + "\n"  # fmt: skip


def plot(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    times = [t / 60 for t, _ in report["rss_samples"]]
    top.plot(times, [b / 2**20 for _, b in report["rss_samples"]])
    top.axvline(report["config"]["warmup"] / 60, color="grey", linestyle="--", label="warm-up end")
    top.set_ylabel("server RSS (MiB)")
    top.legend()
    done = [r for r in report["request_log"] if r["status"] == "200"]
    bottom.scatter([r["started"] / 60 for r in done], [r["seconds"] for r in done], s=4)
    failed = [r for r in report["request_log"] if r["status"] != "200"]
    if failed:
        bottom.scatter(
            [r["started"] / 60 for r in failed], [r["seconds"] for r in failed], s=12, c="red"
        )
    bottom.set_ylabel("request latency (s)")
    bottom.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, threads: int, extra: list[str]) -> subprocess.Popen:
    """`selfspec serve` in its own process; returns once /health answers."""
    command = [sys.executable, "-m", "selfspec.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--threads", str(threads), *extra]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise RuntimeError("the server did not answer /health within 600 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=300.0, help="seconds before the baseline")
    parser.add_argument("--sample-every", type=float, default=5.0, help="RSS sampling, seconds")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--prompts", type=Path, default=HELDOUT)
    parser.add_argument("--out", type=Path, default=Path("runs/soak"))
    parser.add_argument(
        "server_args", nargs="*", help="more `selfspec serve` flags (after --)", default=[]
    )
    args = parser.parse_args(argv)
    try:
        config = SoakConfig(
            args.duration, args.clients, args.warmup, args.sample_every, args.max_tokens
        )
    except ValueError as error:
        parser.error(str(error))
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line]
    port = free_port()
    server = start_server(port, args.threads, list(args.server_args))
    try:
        url = f"http://127.0.0.1:{port}"
        models = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        print(f"soak: {config.clients} clients for {config.duration:.0f} s on {models}", flush=True)
        report = soak(url, server.pid, models, prompts, config)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    report = {"machine": {**machine_record(), "threads": args.threads}, **report}
    write_report(args.out, report, markdown(report), stem="soak")
    written = plot(report, args.out / "soak.png")
    if written is not None:
        print(f"wrote {written}")
    return 0 if report["rss_within_5pct"] and not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
