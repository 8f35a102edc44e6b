"""Callback that exports the trained heads (core format) and measures τ when a fit ends.

Writes ``output_dir/config.json`` + ``model.safetensors`` via ``save_heads`` with the training
metrics and τ in its ``extra``, and the same record as ``output_dir/metrics.json`` beside them.
Only rank 0 writes; every rank reaches the same barrier, so no rank leaves early.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from selfspec.heads import HeadKind
from selfspec.train.length_batches import LengthGroupedBatches
from selfspec.train.module import HeadsModule
from selfspec.train.prompts import OnBadLine, read_prompts
from selfspec.train.shards import write_json
from selfspec.train.tau import default_trees, measure_tau


class ExportHeads(L.Callback):
    def __init__(
        self,
        output_dir: str,
        tau_prompts: str | None = None,
        tau_num_prompts: int = 20,
        tau_max_new_tokens: int = 128,
        snapshot_every_tokens: int | None = None,
    ) -> None:
        """
        Args:
            output_dir: where the heads are exported (replaced atomically).
            tau_prompts: JSONL of held-out prompts for measuring τ with the engine; None skips it.
            tau_num_prompts: how many of them (the first ones).
            tau_max_new_tokens: tokens generated per prompt.
            snapshot_every_tokens: also export the heads (without τ) each time this many more
                response tokens have been trained on, to ``<output_dir>-snapshots/tokens-N``
                (``benchmarks/tau_vs_tokens.py`` measures τ against N); None: never.
        """
        if snapshot_every_tokens is not None and snapshot_every_tokens < 1:
            raise ValueError(f"snapshot_every_tokens must be >= 1, got {snapshot_every_tokens}")
        self.output_dir = Path(output_dir)
        self.tau_prompts = tau_prompts
        self.tau_num_prompts = tau_num_prompts
        self.tau_max_new_tokens = tau_max_new_tokens
        self.snapshot_every_tokens = snapshot_every_tokens
        self._started = 0.0
        self._tokens = 0.0
        self._response_tokens = 0
        self._next_snapshot = snapshot_every_tokens
        self._batch_started = 0.0
        self._batch_seconds = 0.0
        """Wall time inside training batches (forward, backward, optimizer), validation excluded."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        seconds = time.perf_counter() - self._batch_started
        tokens = float(batch["lengths"].sum())
        self._tokens += tokens
        self._batch_seconds += seconds
        pl_module.log("train/tokens_per_s", tokens / max(seconds, 1e-9), prog_bar=True)
        self._response_tokens += int((batch["lengths"] - batch["prompt_len"]).clamp(min=0).sum())
        if self._next_snapshot is not None and self._response_tokens >= self._next_snapshot:
            if trainer.is_global_zero:
                self.snapshot(trainer, pl_module)
            self._next_snapshot += self.snapshot_every_tokens

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, HeadsModule):
            raise TypeError("ExportHeads needs a HeadsModule")
        if trainer.is_global_zero:
            self.export(trainer, pl_module)
        trainer.strategy.barrier("selfspec-export")

    def snapshot(self, trainer: L.Trainer, module: HeadsModule) -> Path:
        """The heads as they are now, with the response tokens trained on so far (this run)."""
        snapshots = self.output_dir.with_name(self.output_dir.name + "-snapshots")
        out = snapshots / f"tokens-{self._response_tokens:09d}"
        record = {
            "kind": module.kind.value,
            "global_step": trainer.global_step,
            "response_tokens_seen_this_run_rank0": self._response_tokens,
            "tokens_seen_this_run_rank0": int(self._tokens),
            **self._lineage(module),
        }
        was_training = module.heads.training
        module.heads.eval()
        module.export(out, extra=record)
        module.heads.train(was_training)
        write_json(out / "metrics.json", record)
        return out

    def _lineage(self, module: HeadsModule) -> dict[str, Any]:
        """Response tokens the heads have been trained on in all, counting the runs before this
        one when it continued from exported heads (``init_from``) whose metrics.json says."""
        before = response_tokens_total(Path(module.init_from)) if module.init_from else 0
        return {
            "init_from": module.init_from,
            "response_tokens_before_this_run": before,
            "response_tokens_total": before + self._response_tokens,
        }

    def export(self, trainer: L.Trainer, module: HeadsModule) -> dict[str, Any]:
        metrics = {
            k: round(float(v), 5)
            for k, v in trainer.callback_metrics.items()
            if k.startswith(("val/", "train/"))
        }
        record: dict[str, Any] = {
            "kind": module.kind.value,
            "target": module.target_spec.model or "SmolLM2-135M-Instruct",
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            # Where the data order stands: a run continuing these heads (init_from) starts in
            # epoch ``data_epoch`` of the seeded order and skips ``batches_done`` batches of it
            # (``--data.first_epoch``, ``--data.skip_batches``; same seed and batch size).
            **_data_position(trainer),
            "training_seconds_this_run": round(time.perf_counter() - self._started, 1),
            "tokens_seen_this_run_rank0": int(self._tokens),
            "response_tokens_seen_this_run_rank0": self._response_tokens,
            **self._lineage(module),
            "train_tokens_per_s_rank0": round(self._tokens / max(self._batch_seconds, 1e-9), 1),
            "world_size": trainer.world_size,
            "loss_weights": vars(module.loss_weights),
            "loss_vocab_size": module.loss_vocab_size,
            "loss_vocab_coverage": round(module.loss_vocab_coverage, 5),
            "optim": vars(module.optim),
            "bf16_autocast": module._autocast_enabled,
            "metrics": metrics,
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor(),
                "torch_threads": torch.get_num_threads(),
                "dtype": str(module.target.dtype),
            },
        }
        if module.kind is HeadKind.EAGLE3:
            record["ttt"] = vars(module.ttt)
            record["target_layers"] = list(module.heads.config.target_layers)
        module.heads.eval()
        if self.tau_prompts is not None:
            records, _ = read_prompts(self.tau_prompts, OnBadLine.fail)
            prompts = [r.prompt for r in records[: self.tau_num_prompts]]
            trees = default_trees(module.heads)
            trees = measure_tau(
                module.target.model,
                module.heads,
                module.tokenizer,
                prompts,
                trees,
                self.tau_max_new_tokens,
            )
            record["tau"] = {"prompts_file": Path(self.tau_prompts).name, "greedy": trees}
        module.export(self.output_dir, extra=record)
        write_json(self.output_dir / "metrics.json", record)
        print(json.dumps({"exported": str(self.output_dir), **record.get("tau", {})}, indent=2))
        return record


def _data_position(trainer: L.Trainer) -> dict[str, int]:
    """Where this run left the seeded batch order (``LengthGroupedBatches``): the epoch it was
    in, the batches of that epoch done (a skip at the start of this run included) and the
    batches an epoch has. Without a seeded order: the batches this run read (and skipped)."""
    datamodule = getattr(trainer, "datamodule", None)
    skipped = int(getattr(datamodule, "skip_batches", 0) or 0)
    first = int(getattr(datamodule, "first_epoch", 0) or 0)
    read = int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)
    sampler = getattr(trainer.train_dataloader, "batch_sampler", None)
    if not isinstance(sampler, LengthGroupedBatches):
        return {"data_epoch": first, "batches_done": skipped + read}
    full = sampler.epoch_batches
    position = skipped + read
    return {
        "data_epoch": first + position // full,
        "batches_done": position % full,
        "epoch_batches": full,
    }


def response_tokens_total(heads_dir: Path) -> int:
    """Response tokens exported heads were trained on, all runs (0 when their metrics.json is
    missing or records none: heads from elsewhere)."""
    try:
        record = json.loads((heads_dir / "metrics.json").read_text())
        key = "response_tokens_total"
        return int(record[key] if key in record else record["response_tokens_seen_this_run_rank0"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
