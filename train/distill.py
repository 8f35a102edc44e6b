"""Self-distillation: the target answers the prompts; its answers (and features) are the data.

Heads learn to predict what the target itself would say, so the training text is the target's own
output for prompts under its chat template. Generation is HF ``generate`` in left-padded batches.
With ``store_features`` the target's last hidden state at every position is captured by a hook
on the decoder body during generation, so training never runs the target again; with
``tap_layers`` too, its states entering those layers (what EAGLE-3 heads read) are captured in
the same forwards (``layer_features``, named by ``layer_ids``).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from selfspec.drafting.taps import LayerTaps, maybe_capture
from selfspec.fingerprint import fingerprint_of
from selfspec.generation import eos_token_ids
from selfspec.target import LoadedTarget, TargetSpec, apply_chat_template, load_target
from selfspec.train.memory import check_fits
from selfspec.train.prompts import BadLine, OnBadLine, PromptsError, read_prompts
from selfspec.train.shards import (
    MANIFEST,
    finished_key,
    shard_dir,
    shard_key,
    write_json,
    write_shard,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig:
    """What to distil and how."""

    prompts: str
    """A JSONL file of {"prompt": ...} / {"messages": [...]} lines, or a datasets directory."""
    output: str
    """Directory of the distilled dataset (shards); an existing one is resumed."""
    target: TargetSpec = field(default_factory=TargetSpec)
    """The target that answers (default: the embedded SmolLM2-135M-Instruct)."""
    max_new_tokens: int = 160
    """Longest response, in tokens; a response also ends at the target's EOS."""
    max_prompt_tokens: int = 512
    """Longer prompts (after the chat template) are bad lines: reported, then skipped or fatal."""
    batch_size: int = 32
    """Prompts generated together (left-padded)."""
    shard_size: int = 128
    """Prompts per shard, the unit of resumption."""
    do_sample: bool = False
    """False: greedy responses. True: sample with temperature / top_p."""
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    """Shard i samples with seed + i, so a resumed run gives what an uninterrupted one gives."""
    store_features: bool = True
    """Keep the target's last hidden state per position (float16), so training skips the target."""
    tap_layers: tuple[int, ...] = ()
    """With ``store_features``: also keep the target's states entering these layers (HF's
    ``output_hidden_states`` indices; EAGLE-3 heads' ``target_layers``), concatenated per position
    as ``layer_features`` (float16), with a ``layer_ids`` column naming them."""
    on_bad_line: OnBadLine = OnBadLine.fail
    """What a bad prompt line does: "skip" (reported with its line number) or "fail"."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_bad_line", OnBadLine(self.on_bad_line))
        for name in ("max_new_tokens", "max_prompt_tokens", "batch_size", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"distill {name} must be >= 1, got {getattr(self, name)}")
        object.__setattr__(self, "tap_layers", tuple(int(k) for k in self.tap_layers))
        if self.tap_layers and not self.store_features:
            raise ValueError("distill tap_layers needs store_features (rows keep both)")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                "distill needs temperature > 0 and 0 < top_p <= 1, "
                f"got {self.temperature}, {self.top_p}"
            )


@dataclass(frozen=True)
class DistillReport:
    rows: int
    generated_tokens: int
    seconds: float
    shards_done: int
    shards_skipped: int
    bad_lines: int

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


def distill(config: DistillConfig, loaded: LoadedTarget | None = None) -> DistillReport:
    """Generate every shard not already finished with the same prompts and settings."""
    loaded = loaded or load_target(config.target)
    model, tokenizer = loaded.model, loaded.tokenizer
    out = Path(config.output)
    records, bad = read_prompts(config.prompts, config.on_bad_line)
    encoded: list[tuple[int, list[int]]] = []
    for record in records:
        ids = apply_chat_template(tokenizer, record.prompt)
        if len(ids) > config.max_prompt_tokens:
            reason = (
                f"prompt has {len(ids)} tokens, more than "
                f"max_prompt_tokens={config.max_prompt_tokens}"
            )
            if config.on_bad_line is OnBadLine.fail:
                raise PromptsError(f"{config.prompts}:{record.source_index}: {reason}")
            logger.warning("%s:%d: skipped: %s", config.prompts, record.source_index, reason)
            bad.append(BadLine(record.source_index, reason))
            continue
        encoded.append((record.source_index, ids))
    if not encoded:
        raise PromptsError(f"prompts {config.prompts} has no prompt within max_prompt_tokens")
    longest = max(len(ids) for _, ids in encoded) + config.max_new_tokens
    check_fits(
        _generation_bytes(model, config.batch_size, longest, len(config.tap_layers)),
        model.device,
        f"distill batch_size={config.batch_size} x {longest} tokens",
    )
    settings = _settings(config, loaded)
    shards = [encoded[i : i + config.shard_size] for i in range(0, len(encoded), config.shard_size)]
    done = skipped = tokens = 0
    started = time.perf_counter()
    bar = tqdm(total=len(encoded), desc="distill", unit="prompt")
    for index, shard in enumerate(shards):
        path = shard_dir(out, index)
        key = shard_key(settings, [ids for _, ids in shard])
        if finished_key(path) == key:
            skipped += 1
            bar.update(len(shard))
            continue
        shard_started = time.perf_counter()
        hidden = model.get_input_embeddings().weight.shape[1]
        rows = _generate_shard(model, tokenizer, shard, config, config.seed + index, bar)
        produced = sum(rows["response_len"])
        write_shard(
            path,
            rows,
            {
                "key": key,
                "rows": len(shard),
                "generated_tokens": produced,
                "seconds": round(time.perf_counter() - shard_started, 2),
            },
            features=hidden,
            extra=tapped_schema(config.tap_layers, hidden),
        )
        done += 1
        tokens += produced
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - started):.1f}")
    bar.close()
    for stale in sorted(out.glob("shard-*")):
        if int(stale.name.split("-")[1]) >= len(shards):
            logger.warning("removing %s: not part of this run's %d shards", stale, len(shards))
            shutil.rmtree(stale, ignore_errors=True)
    report = DistillReport(
        rows=len(encoded),
        generated_tokens=tokens,
        seconds=time.perf_counter() - started,
        shards_done=done,
        shards_skipped=skipped,
        bad_lines=len(bad),
    )
    write_json(
        out / MANIFEST,
        {
            "settings": settings,
            "shards": len(shards),
            "rows": len(encoded),
            "bad_lines": len(bad),
            "last_run": asdict(report),
        },
    )
    return report


def _settings(config: DistillConfig, loaded: LoadedTarget) -> dict[str, Any]:
    """Everything that changes the generated rows (not batch size: it only changes padding)."""
    return {
        "target": loaded.name,
        "base": fingerprint_of(loaded.model).to_dict(),
        "dtype": str(loaded.model.dtype),
        "max_new_tokens": config.max_new_tokens,
        "do_sample": config.do_sample,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "seed": config.seed,
        "store_features": config.store_features,
        **({"tap_layers": list(config.tap_layers)} if config.tap_layers else {}),
    }


def _generation_bytes(model: torch.nn.Module, batch: int, length: int, taps: int = 0) -> int:
    """KV cache + captured features (the last hidden state and ``taps`` tapped layers' states)
    + one step's logits, all float32."""
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 1)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 1)
    hidden = model.get_input_embeddings().weight.shape[1]
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    kv = 2 * layers * kv_heads * (hidden // heads)
    vocab = model.get_output_embeddings().weight.shape[0]
    return 4 * batch * (length * (kv + (1 + taps) * hidden) + 2 * vocab)


@torch.no_grad()
def _generate_shard(
    model, tokenizer, shard, config: DistillConfig, seed: int, bar
) -> dict[str, list]:
    columns: dict[str, list] = {
        k: [] for k in ("input_ids", "prompt_len", "response_len", "finished", "source_index")
    }
    if config.store_features:
        columns["features"] = []
    if config.tap_layers:
        columns["layer_features"], columns["layer_ids"] = [], []
    order = sorted(range(len(shard)), key=lambda i: len(shard[i][1]))  # less padding per batch
    results: dict[int, tuple] = {}
    with torch.random.fork_rng(devices=[]):  # HF sampling draws from the global generator
        torch.manual_seed(seed)
        for start in range(0, len(order), config.batch_size):
            batch = [order[i] for i in range(start, min(start + config.batch_size, len(order)))]
            for i, row in zip(
                batch,
                _generate_batch(model, tokenizer, [shard[i][1] for i in batch], config),
                strict=True,
            ):
                results[i] = row
            bar.update(len(batch))
    for i, (ids, prompt_len, response_len, finished, features, tapped) in sorted(results.items()):
        columns["input_ids"].append(ids)
        columns["prompt_len"].append(prompt_len)
        columns["response_len"].append(response_len)
        columns["finished"].append(finished)
        columns["source_index"].append(shard[i][0])
        if config.store_features:
            columns["features"].append(features)
        if config.tap_layers:
            columns["layer_features"].append(tapped)
            columns["layer_ids"].append(list(config.tap_layers))
    return columns


def _generate_batch(
    model, tokenizer, prompts: list[list[int]], config: DistillConfig
) -> list[tuple]:
    """(ids, prompt_len, response_len, finished, features [len-1, H], tapped [len-1, k*H]) per
    prompt, both float16 numpy (None when not stored)."""
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the same column
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    sampling = (
        {"do_sample": True, "temperature": config.temperature, "top_p": config.top_p, "top_k": None}
        if config.do_sample
        else {"do_sample": False}
    )
    captured: list[torch.Tensor] = []  # per forward: [B, n, H]
    captured_taps: list[torch.Tensor] = []  # per forward: [B, n, k*H]
    body = model.get_decoder()
    taps = LayerTaps(body, config.tap_layers) if config.tap_layers else None
    with contextlib.ExitStack() as stack:
        record = stack.enter_context(maybe_capture(taps))

        def keep(_module, _args, output) -> None:  # after each forward: its states, all read
            captured.append(output.last_hidden_state)
            if record is not None:
                captured_taps.append(record.stacked())

        if config.store_features:
            stack.callback(body.register_forward_hook(keep).remove)
        out = model.generate(
            input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            max_new_tokens=config.max_new_tokens,
            eos_token_id=list(eos),
            pad_token_id=pad,
            **sampling,
        ).cpu()  # [B, width + new]
    features = torch.cat(captured, dim=1).float().cpu() if captured else None  # [B, width+new-1, H]
    tapped = torch.cat(captured_taps, dim=1).float().cpu() if captured_taps else None
    rows = []
    for row, prompt in enumerate(prompts):
        response = out[row, width:].tolist()
        ends = [i for i, t in enumerate(response) if t in eos]
        finished = bool(ends)
        response = response[: ends[0] + 1] if finished else response
        ids = list(prompt) + response
        offset = width - len(prompt)
        kept = slice(offset, offset + len(ids) - 1)
        feats = None if features is None else features[row, kept].to(torch.float16).numpy()
        taps_row = None if tapped is None else tapped[row, kept].to(torch.float16).numpy()
        rows.append((ids, len(prompt), len(response), finished, feats, taps_row))
    return rows


def tapped_schema(layers: tuple[int, ...], hidden: int) -> dict[str, Any] | None:
    """The `datasets` types of the tapped columns (None without taps)."""
    if not layers:
        return None
    from datasets import Array2D, Value
    from datasets import Sequence as Seq

    return {
        "layer_features": Array2D(shape=(None, len(layers) * hidden), dtype="float16"),
        "layer_ids": Seq(Value("int32")),
    }


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids = eos_token_ids(model, tokenizer)
    if not ids:
        raise ValueError("the target has no EOS token id; distillation needs one to end responses")
    return ids
