"""Drift under a running server: an adapter swapped for a heavier-shift one is flagged, then
recalibrated in the background from its own served outputs (``selfspec serve --recalibrate``).

One server in this process (127.0.0.1, the embedded default model, the shipped EAGLE heads, a
fixed tree so τ does not follow the machine's load), adapters from the shipped examples copied
without their recalibrated heads:

1. the same held-out prompts on the base and on ``tenant`` (the mild ``code`` adapter), in
   turn: its drift score on comparable traffic;
2. ``tenant`` unloaded and loaded again from the heavy ``shout`` adapter (the management
   routes), as an operator replacing an adapter under a name would; traffic on it until the
   drift monitor flags it: **N requests**;
3. τ of the shared heads under ``shout`` on held-out prompts (through ``shout-ref``, the same
   weights under another name, which never trains), while ``tenant`` gathers its rows;
4. traffic on ``tenant`` until its gathered requests are trained on in the background process
   and judged; then τ of ``tenant`` on the same held-out prompts with the swapped-in delta;
5. every held-out answer compared with vanilla decoding (speculation off): equal, token for
   token.

    .venv/bin/python benchmarks/drift_recalibration.py --out runs/drift_recalibration

Writes ``drift_recalibration.json`` and ``.md`` into ``--out``. τ is counted by the server
(committed tokens per target forward); times are wall clock on this machine, reported only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

from selfspec.adapters.prompts import default_prompts_file, read_prompt_file
from selfspec.adapters.shipped import examples_root
from selfspec.atomic import write_text_atomic
from selfspec.reports import machine_record
from selfspec.serve.background import running_server
from selfspec.serve.cli import ServeArgs, build_state

TRAFFIC = Path(__file__).resolve().parents[1] / "train" / "data" / "prompts.jsonl"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "selfspec_adapter.json")


def _messages(prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _copy_adapter(name: str, destination: Path) -> None:
    """A shipped example's weights and config (not its recalibrated heads)."""
    destination.mkdir(parents=True)
    for file in ADAPTER_FILES:
        source = examples_root() / name / file
        if source.is_file():
            shutil.copy(source, destination / file)


class Client:
    def __init__(self, url: str, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.http = httpx.Client(timeout=600)

    def chat(self, model: str, prompt, speculation: bool = True) -> dict:
        body = {
            "model": model,
            "messages": _messages(prompt),
            "temperature": 0,
            "max_tokens": self.max_tokens,
            "speculation": speculation,
        }
        reply = self.http.post(f"{self.url}/v1/chat/completions", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"{model}: {reply.status_code} {reply.text[:300]}")
        return reply.json()

    def manage(self, route: str, body: dict) -> None:
        reply = self.http.post(f"{self.url}/v1/{route}", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"{route}: {reply.status_code} {reply.text[:300]}")


def _tau(replies: list[dict]) -> float:
    forwards = sum(r["selfspec"]["target_forwards"] for r in replies)
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    return tokens / max(forwards, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--eval-prompts", type=int, default=12)
    parser.add_argument(
        "--mild-rounds", type=int, default=8, help="prompts sent to the base and the mild adapter"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tree", default="dynamic:4,4,8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/drift_recalibration")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    traffic = read_prompt_file(TRAFFIC)
    # Held-out prompts (never trained on): the first for τ, the rest as the mild phase's traffic.
    heldout_file = read_prompt_file(default_prompts_file())
    heldout, mild_prompts = heldout_file[: args.eval_prompts], heldout_file[args.eval_prompts :]
    work = Path(tempfile.mkdtemp(prefix="drift-"))
    root = work / "adapters"
    for name, source in (("tenant", "code"), ("shout-ref", "shout"), ("shout-src", "shout")):
        _copy_adapter(source, root / name)
    state = build_state(
        ServeArgs(
            adapters_root=str(root),
            tree=args.tree,
            speculation_gate=False,  # every round drafts: τ is the heads', not the gate's
            recalibrate="drift",
            recalibrate_conversations=args.conversations,
            enable_lora_management=True,
            threads=args.threads,
        )
    )
    monitor = state.metrics.drift
    started = time.perf_counter()
    record: dict = {"settings": vars(args), "machine": _machine()}
    next_prompt = iter(traffic)
    try:
        with running_server(state) as (url, _):
            client = Client(url, args.max_tokens)
            base = state.model_name
            rounds = 0
            comparable = iter(mild_prompts)
            with tqdm(desc="mild adapter", unit="round") as bar:
                while monitor.score("tenant") is None or rounds < args.mild_rounds:
                    prompt = next(comparable)  # the same prompt on both: comparable traffic
                    for model in (base, "tenant"):
                        client.chat(model, prompt)
                    rounds += 1
                    bar.update()
            record["mild_requests"] = rounds
            record["mild_score"] = round(monitor.score("tenant"), 3)
            record["mild_flagged"] = "tenant" in monitor.flagged()

            client.manage("unload_lora_adapter", {"lora_name": "tenant"})
            client.manage("load_lora_adapter", {"lora_name": "tenant", "lora_path": "shout-src"})
            requests = 0
            with tqdm(desc="until flagged", unit="req") as bar:
                while "tenant" not in monitor.flagged():
                    client.chat("tenant", next(next_prompt))
                    requests += 1
                    bar.update()
                    if requests > 200:
                        raise RuntimeError("the heavy adapter was never flagged")
            record["requests_until_flagged"] = requests
            record["heavy_score"] = round(monitor.score("tenant"), 3)
            client.chat("tenant", next(next_prompt))  # tenant is now the adapter gathering rows

            shared = [client.chat("shout-ref", p) for p in tqdm(heldout, desc="tau shared")]
            recalibrator = state.recalibrator
            with tqdm(desc="gathering", unit="req") as bar:
                while not recalibrator.outcomes and recalibrator.training is None:
                    client.chat("tenant", next(next_prompt))
                    bar.update()
            gathered_at = time.perf_counter()
            recalibrator.wait_idle(3600)
            record["training_seconds"] = round(time.perf_counter() - gathered_at, 1)
            (outcome,) = recalibrator.outcomes
            record["outcome"] = {
                "outcome": outcome.outcome,
                "detail": outcome.detail,
                "report": outcome.report,
            }
            tuned = [client.chat("tenant", p) for p in tqdm(heldout, desc="tau recalibrated")]
            vanilla = [client.chat("tenant", p, False) for p in tqdm(heldout, desc="vanilla")]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def texts(replies: list[dict]) -> list[str]:
        return [r["choices"][0]["message"]["content"] for r in replies]

    record.update(
        tau_shared=round(_tau(shared), 3),
        tau_recalibrated=round(_tau(tuned), 3),
        greedy_equal=sum(a == b for a, b in zip(texts(tuned), texts(vanilla), strict=True)),
        greedy_equal_shared=sum(a == b for a, b in zip(texts(shared), texts(vanilla), strict=True)),
        eval_prompts=len(heldout),
        seconds=round(time.perf_counter() - started, 1),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "drift_recalibration.json", json.dumps(record, indent=2) + "\n")
    write_text_atomic(out / "drift_recalibration.md", _markdown(record))
    print(_markdown(record))
    return 0


def _markdown(r: dict) -> str:
    report = r["outcome"]["report"] or {}
    before = report.get("served", {}).get("top1")
    after = report.get("after", {}).get("top1")
    return "\n".join(
        [
            "| step | result |",
            "|---|---|",
            f"| mild adapter (`code`) drift score after the same {r['mild_requests']} held-out "
            f"prompts as the base | {r['mild_score']} (flagged: {r['mild_flagged']}) |",
            f"| swapped for `shout`: requests until flagged | {r['requests_until_flagged']} "
            f"(score {r['heavy_score']}) |",
            f"| background recalibration | {r['outcome']['outcome']}: held-back top-1 "
            f"{before} -> {after}, {r['training_seconds']} s after the last row |",
            f"| τ on {r['eval_prompts']} held-out prompts, shared heads | {r['tau_shared']} |",
            f"| τ with the swapped-in delta | {r['tau_recalibrated']} |",
            f"| greedy equal to vanilla | {r['greedy_equal']}/{r['eval_prompts']} (shared: "
            f"{r['greedy_equal_shared']}/{r['eval_prompts']}) |",
            "",
            f"Settings: {r['settings']}; {r['machine']}; {r['seconds']} s in all.",
            "",
        ]
    )


def _machine() -> str:
    machine = machine_record()
    flags = " ".join(machine["flags"]) or "no AVX flags read"
    return f"{machine['cpu']}, {flags}, {machine['threads']} torch threads, fp32"


if __name__ == "__main__":
    sys.exit(main())
