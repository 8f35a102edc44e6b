"""Time to first token with a long shared system prompt, prefix cache on vs off, side by side.

Two servers of the embedded default model run in this process (shipped EAGLE heads, default
tree), one with the prefix cache and one without; requests alternate between them. Each request
is a streaming chat completion whose system prompt (~1,000 tokens of text installed with Python:
the `collections` module's docstrings) is shared by every request and whose user question is
new. TTFT is the time to the first content chunk; the first request of each server (which fills
the cache) is reported apart, not in the medians.

    .venv/bin/python benchmarks/prefix_ttft.py --rounds 10 --out runs/prefix_ttft
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

from selfspec.atomic import write_text_atomic
from selfspec.reports import machine_record
from selfspec.serve.background import running_server
from selfspec.serve.cli import ServeArgs, build_state
from selfspec.target import apply_chat_template


def system_prompt(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of installed text."""
    text = " ".join(
        " ".join(inspect.getdoc(obj).split())
        for obj in (collections, *vars(collections).values())
        if inspect.getdoc(obj)
    )
    ids = tokenizer.encode(text)[:tokens]
    return tokenizer.decode(ids)


def first_token_seconds(url: str, model: str, system: str, question: str) -> float:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without content")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/prefix_ttft"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_record()
    print(f"{machine['cpu']} (flags: {' '.join(machine['flags'])}); torch threads {args.threads}")
    states = {
        "cached": build_state(ServeArgs(threads=args.threads, prefix_cache_mb=512)),
        "uncached": build_state(ServeArgs(threads=args.threads, prefix_cache_mb=0)),
    }
    tokenizer = states["cached"].tokenizer
    system = system_prompt(tokenizer, args.system_tokens)
    model = states["cached"].model_name
    seconds: dict[str, list[float]] = {"cached": [], "uncached": []}
    first: dict[str, float] = {}
    with (
        running_server(states["cached"]) as (cached_url, _),
        running_server(states["uncached"]) as (uncached_url, _),
    ):
        urls = {"cached": cached_url, "uncached": uncached_url}
        for name, url in urls.items():
            first[name] = first_token_seconds(url, model, system, "Say hello.")
        for round_ in range(args.rounds):
            question = f"In one sentence, what is item {round_ + 1} about?"
            order = ("cached", "uncached") if round_ % 2 == 0 else ("uncached", "cached")
            for name in order:
                seconds[name].append(first_token_seconds(urls[name], model, system, question))
            print(
                f"round {round_ + 1}: cached {seconds['cached'][-1]:.3f} s, "
                f"uncached {seconds['uncached'][-1]:.3f} s",
                flush=True,
            )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "x"}]
    prompt_tokens = len(apply_chat_template(tokenizer, messages))
    p50 = {name: statistics.median(values) for name, values in seconds.items()}
    result = {
        "machine": machine,
        "prompt_tokens": prompt_tokens,
        "rounds": args.rounds,
        "first_request_s": first,
        "ttft_p50_s": p50,
        "ratio_cached_over_uncached": p50["cached"] / p50["uncached"],
        "seconds": seconds,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "result.json", json.dumps(result, indent=2))
    print(
        f"TTFT p50 with a {prompt_tokens}-token prompt: cached {p50['cached']:.3f} s, uncached "
        f"{p50['uncached']:.3f} s, ratio {result['ratio_cached_over_uncached']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
