"""Data-engine generation throughput: batched (continuous batching, ``BatchDecoder``) vs one
request at a time, side by side in one run, per mode; HF ``generate`` in left-padded batches
(what ``selfspec distill`` uses) as a reference.

tokens/s counts response tokens over the whole call, prefill included. Requests: chat prompts
of ``train/data/prompts.jsonl`` (never the held-out benchmark set), ``--max-new-tokens`` each,
every other one sampled (T 0.8, top-p 0.95, own seed), the rest greedy; every request stops at
EOS. The one-at-a-time rows run the first ``--single`` requests; the batched rows all of
``--requests`` (several batches' worth, so the tail, when the batch drains, weighs little).

    .venv/bin/python benchmarks/datagen_throughput.py --out runs/datagen-throughput
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from selfspec.cost_curve import cpu_flags
from selfspec.sampling import SamplingParams
from selfspec.target import TargetSpec, apply_chat_template, load_target
from selfspec.train.datagen.batch_decoder import BatchDecoder, GenerationRequest

PROMPTS = Path(__file__).resolve().parents[1] / "train" / "data" / "prompts.jsonl"
MODES = {
    "bf16 (oneDNN linear, kernels' attention)": TargetSpec(dtype="bfloat16", kernels=False),
    "fp32 (kernels, GGUF blocks)": TargetSpec(dtype="float32"),
}


def requests(tokenizer, count: int, max_new: int) -> list[GenerationRequest]:
    lines = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()[:count]]
    out = []
    for i, prompt in enumerate(lines):
        sampling = SamplingParams() if i % 2 else SamplingParams(temperature=0.8, top_p=0.95)
        ids = tuple(apply_chat_template(tokenizer, prompt))
        out.append(GenerationRequest(str(i), ids, max_new, sampling, seed=i, stop_ids=(2,)))
    return out


def timed_decoder(model, reqs, batch: int, max_new: int) -> tuple[int, float]:
    decoder = BatchDecoder(model, batch_size=batch, max_prompt_tokens=512, max_new_tokens=max_new)
    list(decoder.generate(reqs[:1]))  # allocate its cache, warm up
    started = time.perf_counter()
    tokens = sum(len(r.response) for r in decoder.generate(reqs))
    return tokens, time.perf_counter() - started


def timed_hf(model, reqs, batch: int, max_new: int) -> tuple[int, float]:
    """HF generate, left-padded batches, greedy (its batches cannot mix sampling settings)."""
    started, tokens = time.perf_counter(), 0
    for start in range(0, len(reqs), batch):
        group = [r.prompt for r in reqs[start : start + batch]]
        width = max(map(len, group))
        ids = torch.full((len(group), width), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(group):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )[:, width:]
        for row in out.tolist():
            tokens += row.index(2) + 1 if 2 in row else len(row)
    return tokens, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--single", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate reference")
    parser.add_argument("--out", type=Path, default=Path("runs/datagen-throughput"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for mode in args.modes:
        loaded = load_target(MODES[mode])
        reqs = requests(loaded.tokenizer, args.requests, args.max_new_tokens)
        single = timed_decoder(loaded.model, reqs[: args.single], 1, args.max_new_tokens)
        batched = timed_decoder(loaded.model, reqs, args.batch, args.max_new_tokens)
        for name, (tokens, seconds), n, batch in (
            ("one at a time", single, args.single, 1),
            (f"batched ({args.batch})", batched, len(reqs), args.batch),
        ):
            rows.append(
                dict(
                    mode=mode,
                    method=name,
                    requests=n,
                    batch=batch,
                    tokens=tokens,
                    seconds=round(seconds, 1),
                    tok_s=round(tokens / seconds, 1),
                )
            )
            print(rows[-1], flush=True)
        if not args.no_hf and "bf16" in mode:
            hf = load_target(TargetSpec(dtype="bfloat16", kernels=False, packed_weights=False))
            tokens, seconds = timed_hf(hf.model, reqs, args.batch, args.max_new_tokens)
            rows.append(
                dict(
                    mode="bf16 (HF generate)",
                    method=f"HF batched ({args.batch})",
                    requests=len(reqs),
                    batch=args.batch,
                    tokens=tokens,
                    seconds=round(seconds, 1),
                    tok_s=round(tokens / seconds, 1),
                )
            )
            print(rows[-1], flush=True)
    for row in rows:
        base = next(
            r
            for r in rows
            if r["method"] == "one at a time"
            and (r["mode"] == row["mode"] or "HF" in row["mode"] and "bf16" in r["mode"])
        )
        row["vs_one_at_a_time"] = round(row["tok_s"] / base["tok_s"], 2)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "flags": cpu_flags(),
        "threads": args.threads,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    lines = [
        f"CPU flags: {' '.join(machine['flags'])}; {args.threads} thread(s); "
        f"{args.max_new_tokens} new tokens max per request",
        "",
        "| mode | method | requests | tokens | s | tok/s | × one at a time |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['mode']} | {r['method']} | {r['requests']} | {r['tokens']} | {r['seconds']} "
        f"| {r['tok_s']} | {r['vs_one_at_a_time']} |"
        for r in rows
    ]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
