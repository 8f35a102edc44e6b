"""The LightningModule: a frozen target and trainable heads; only the heads are its parameters.

The target is held through `TargetForward`, a plain object, not a child module: Lightning's
checkpoints, DDP's gradient sync and the optimizer see the heads alone, and a checkpoint is a few
MB instead of the target's weights. The target's features come from the distilled rows when they
were stored (``selfspec distill --store_features true``), else from one no-grad forward per batch.
EAGLE-3 heads also read the target's states at their ``target_layers``: from a ``layer_features``
column when the data has one (with ``layer_ids`` naming the layers), else tapped during that same
forward (``selfspec.drafting.taps``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch

from selfspec.drafting.taps import LayerTaps
from selfspec.fingerprint import BaseFingerprint, fingerprint_of
from selfspec.heads import HeadKind, build_heads, heads_config_for, load_heads
from selfspec.heads.delta import (
    Delta,
    DeltaConfig,
    LoraLinear,
    delta_state,
    heads_hash,
    save_delta,
    with_trainable_delta,
)
from selfspec.heads.draft_vocab import draft_vocab_of, with_draft_vocab
from selfspec.heads.eagle3 import Eagle3Head, init_from_target, with_eagle3_draft_vocab
from selfspec.target import TargetSpec, load_target
from selfspec.target_forward import TargetForward
from selfspec.train.draft_vocab import adapter_vocab, frequent_tokens
from selfspec.train.eagle3_loss import TTTConfig, eagle3_loss
from selfspec.train.losses import (
    LossOutput,
    LossWeights,
    eagle_loss,
    medusa_loss,
    response_positions,
)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay to ``min_lr_ratio`` * lr."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    """Set as the Trainer's gradient_clip_val by the recipes; recorded here for the export."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"invalid optimizer settings: {self}")


class HeadsModule(L.LightningModule):
    def __init__(
        self,
        target: TargetSpec | None = None,
        kind: Literal["eagle", "medusa", "eagle3"] = "eagle",
        num_heads: int = 4,
        num_layers: int = 1,
        loss: LossWeights | None = None,
        optim: OptimConfig | None = None,
        init_from: str | None = None,
        loss_vocab_size: int | None = None,
        eagle_depth: int = 1,
        target_layers: list[int] | None = None,
        ttt: TTTConfig | None = None,
        bf16_autocast: Literal["auto", "on", "off"] = "off",
        delta: DeltaConfig | None = None,
    ) -> None:
        """
        Args:
            target: the frozen target (default: the embedded SmolLM2-135M-Instruct).
            kind: "eagle", "medusa" or "eagle3".
            num_heads: Medusa heads (draft depth); ignored by EAGLE.
            num_layers: Medusa residual blocks per head / EAGLE decoder layers (EAGLE-3: 1).
            loss: weights of the loss terms (see selfspec.train.losses).
            optim: optimizer and schedule.
            init_from: a heads checkpoint directory to continue from (same base required).
            loss_vocab_size: compute the losses over this many most frequent response tokens of
                the training data instead of the whole vocabulary (None: whole vocabulary).
            eagle_depth: EAGLE draft depths simulated per training step (1: the EAGLE-1 loss;
                more: EAGLE-3's training-time test, see selfspec.train.losses.eagle_loss).
            target_layers: EAGLE-3: the target layers whose states the heads fuse (indices of HF's
                output_hidden_states); None: low/mid/high = 2, L//2, L-3. Recorded in the heads.
            ttt: EAGLE-3: the training-time test (unrolled steps, their weights, the labels).
                With loss_vocab_size the heads' own lm_head covers exactly that many tokens.
            bf16_autocast: run the steps (heads and the target's forward) under bfloat16
                autocast: "auto" where the device has bfloat16 arithmetic (on a CPU: oneDNN's
                bf16 support, AVX-512 BF16 or AMX), "on", or "off" (float32).
            delta: train a low-rank delta of the heads (``selfspec.heads.delta``) instead of
                the heads: their weights stay frozen and their draft vocabulary is the loss
                vocabulary (needs init_from; recalibration for one adapter).
        """
        super().__init__()
        self.target_spec = target or TargetSpec()
        loaded = load_target(self.target_spec)
        self.tokenizer = loaded.tokenizer
        self.target = TargetForward(loaded.model)
        self.base: BaseFingerprint = fingerprint_of(loaded.model)
        self.kind = HeadKind(kind)
        self.loss_weights = loss or LossWeights()
        self.optim = optim or OptimConfig()
        if loss_vocab_size is not None and loss_vocab_size < 1:
            raise ValueError(f"loss_vocab_size must be >= 1 or None, got {loss_vocab_size}")
        self.loss_vocab_size = loss_vocab_size
        if eagle_depth < 1:
            raise ValueError(f"eagle_depth must be >= 1, got {eagle_depth}")
        self.eagle_depth = eagle_depth
        self.ttt = ttt or TTTConfig()
        self.bf16_autocast = bf16_autocast
        self.delta = delta
        self.init_from = init_from
        if delta is not None and init_from is None:
            raise ValueError("a delta corrects trained heads: give init_from")
        if self.kind is not HeadKind.EAGLE3 and (target_layers is not None or ttt is not None):
            raise ValueError("target_layers and ttt are options of kind eagle3 only")
        self.loss_vocab: torch.Tensor | None = None  # [V'] token ids, set in setup()
        self.delta_vocab: torch.Tensor | None = None  # [V'] a delta's own draft vocabulary
        self.loss_vocab_coverage = 1.0
        """Share of the training responses' tokens inside the loss vocabulary."""
        if init_from is not None:
            self.heads = load_heads(init_from, loaded.model, dtype=torch.float32)
            self.heads.train().requires_grad_(True)
            if self.heads.config.kind is not self.kind:
                raise ValueError(
                    f"init_from {init_from} holds {self.heads.config.kind.value} heads, "
                    f"not {self.kind.value}"
                )
            saved_layers = list(self.heads.config.target_layers)
            if target_layers is not None and list(target_layers) != saved_layers:
                raise ValueError(
                    f"init_from {init_from} reads target layers {saved_layers}, "
                    f"not {list(target_layers)}"
                )
            if isinstance(self.heads, Eagle3Head):
                # Their own lm_head rows are their draft vocabulary's, kept when continued
                # (``_setup_eagle3_vocab``): losses read before ``setup`` already use it.
                self.loss_vocab = self.heads.draft_vocab
        else:
            overrides: dict[str, Any] = {"num_heads": num_heads, "num_layers": num_layers}
            if target_layers is not None:
                overrides["target_layers"] = tuple(target_layers)
            try:
                config = heads_config_for(loaded.model, self.kind, **overrides)
            except ValueError as error:
                raise ValueError(
                    f"heads config does not fit the target {loaded.name}: {error}"
                ) from error
            self.heads = build_heads(config)
            if isinstance(self.heads, Eagle3Head):
                init_from_target(self.heads, self.target.lm_head, _final_norm(self.target))
        self.taps = (
            LayerTaps(self.target.body, self.heads.config.target_layers)
            if isinstance(self.heads, Eagle3Head)
            else None
        )

    def setup(self, stage: str) -> None:
        self.target.model.to(self.device)  # not a child module, so Lightning does not move it
        if self.delta is not None:
            if not any(isinstance(m, LoraLinear) for m in self.heads.modules()):
                vocab = draft_vocab_of(self.heads)
                if isinstance(self.heads, Eagle3Head):
                    vocab = self.heads.draft_vocab
                elif vocab is not None:
                    # The shared vocabulary plus the adapter's own tokens outside it: the delta
                    # carries it (``Delta.draft_vocab``), drafts come from it while it is active.
                    datamodule = self.trainer.datamodule
                    datamodule.setup(stage)
                    counts = datamodule.response_token_counts(self.target.vocab_size)  # [vocab]
                    vocab = adapter_vocab(vocab, counts)
                    self.delta_vocab = vocab
                self.loss_vocab = None if vocab is None else vocab.to(self.device)
                with_trainable_delta(self.heads, self.delta)
            return
        if isinstance(self.heads, Eagle3Head):
            self._setup_eagle3_vocab(stage)
            return
        if self.loss_vocab_size is not None:
            datamodule = self.trainer.datamodule
            datamodule.setup(stage)
            counts = datamodule.response_token_counts(self.target.vocab_size)  # [vocab]
            vocab, self.loss_vocab_coverage = frequent_tokens(counts, self.loss_vocab_size)
            self.loss_vocab = vocab.to(self.device)
        # The heads draft from exactly the tokens they learnt to rank (and are exported so).
        self.heads = with_draft_vocab(self.heads, self.loss_vocab).to(self.device)

    def _setup_eagle3_vocab(self, stage: str) -> None:
        """EAGLE-3 heads train their own lm_head over their draft vocabulary, which is the loss
        vocabulary: chosen from the data for new heads, kept for heads continued from a
        checkpoint (their lm_head rows were trained for it)."""
        heads = self.heads
        if heads.config.draft_vocab_size or self.loss_vocab_size is None:
            if self.loss_vocab_size not in (None, heads.config.draft_rows):
                raise ValueError(
                    f"loss_vocab_size={self.loss_vocab_size}, but the EAGLE-3 heads being "
                    f"continued draft from {heads.config.draft_rows} tokens"
                )
            vocab = heads.draft_vocab
        else:
            datamodule = self.trainer.datamodule
            datamodule.setup(stage)
            counts = datamodule.response_token_counts(self.target.vocab_size)  # [vocab]
            vocab, self.loss_vocab_coverage = frequent_tokens(counts, self.loss_vocab_size)
            heads = with_eagle3_draft_vocab(
                heads, vocab, self.target.lm_head, _final_norm(self.target)
            )
            vocab = heads.draft_vocab
        self.loss_vocab = None if vocab is None else vocab.to(self.device)
        self.heads = heads.to(self.device)

    def _projection(self):
        """The lm_head, restricted to the loss vocabulary when there is one."""
        lm_head = self.target.lm_head
        if self.loss_vocab is None:
            return lm_head
        weight = lm_head.weight[self.loss_vocab]  # [V', H]
        bias = None if lm_head.bias is None else lm_head.bias[self.loss_vocab]
        return lambda x: torch.nn.functional.linear(x, weight, bias)

    # -- steps ---------------------------------------------------------------------------------

    def _features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The target's features f_0 .. f_{L-2} of each row. # [B, L-1, H]"""
        if "features" in batch:
            return batch["features"].to(self.target.dtype)
        with torch.no_grad():
            ids = batch["input_ids"][:, :-1]
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            return self.target.body(input_ids=ids, position_ids=positions).last_hidden_state

    def _eagle3_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's states at the heads' layers # [B, L-1, k*H] and its last hidden states
        # [B, L-1, H] at f_0 .. f_{L-2}: stored, or from one no-grad forward (taps on)."""
        layers = list(self.heads.config.target_layers)
        if "layer_features" in batch and "features" in batch:
            stored = batch["layer_ids"]  # [B, k]
            if stored.shape[-1] != len(layers) or (stored != stored.new_tensor(layers)).any():
                raise ValueError(
                    f"the data's layer_features hold layers {stored[0].tolist()}, the heads "
                    f"read {layers}"
                )
            dtype = self.target.dtype
            return batch["layer_features"].to(dtype), batch["features"].to(dtype)
        with torch.no_grad(), self.taps.capture() as tapped:
            ids = batch["input_ids"][:, :-1]
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            last = self.target.body(input_ids=ids, position_ids=positions).last_hidden_state
        return tapped.stacked(), last

    def _loss(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self._autocast_enabled):
            return self.heads_loss(batch)

    @property
    def _autocast_enabled(self) -> bool:
        if self.bf16_autocast == "auto":
            return bf16_arithmetic(self.device)
        return self.bf16_autocast == "on"

    def heads_loss(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        """The heads' losses on one batch of rows (in full precision; training autocasts)."""
        if isinstance(self.heads, Eagle3Head):
            layer_states, features = self._eagle3_inputs(batch)  # [B, L-1, k*H], [B, L-1, H]
            mask = response_positions(batch["lengths"], batch["prompt_len"], features.shape[1])
            return eagle3_loss(
                self.heads,
                self.target.embed,
                batch["input_ids"],
                layer_states,
                features,
                self._projection(),
                mask,
                self.ttt,
            )
        features = self._features(batch)  # [B, L-1, H]
        mask = response_positions(batch["lengths"], batch["prompt_len"], features.shape[1])
        lm_head = self._projection()
        if self.kind is HeadKind.MEDUSA:
            return medusa_loss(self.heads, lm_head, features, mask, self.loss_weights)
        return eagle_loss(
            self.heads,
            self.target.embed,
            lm_head,
            batch["input_ids"],
            features,
            mask,
            self.loss_weights,
            self.eagle_depth,
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self._loss(batch)
        self.log("train/loss", out.loss, prog_bar=True, sync_dist=True)
        self.log_dict({f"train/{k}": v for k, v in out.parts.items()}, sync_dist=True)
        return out.loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self._loss(batch)
        self.log("val/loss", out.loss, prog_bar=True, sync_dist=True)
        self.log_dict({f"val/{k}": v for k, v in out.parts.items()}, sync_dist=True, prog_bar=False)

    # -- optimisation ----------------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        opt = torch.optim.AdamW(
            self.heads.parameters(), lr=self.optim.lr, weight_decay=self.optim.weight_decay
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup, floor = self.optim.warmup_steps, self.optim.min_lr_ratio

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- checkpoints: heads only -------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The state dict already holds only heads.* (the target is no child); say so for readers.
        checkpoint["selfspec"] = {
            "kind": self.kind.value,
            "base": self.base.to_dict(),
            "heads": self.heads.config.to_dict(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("selfspec", {})
        if saved.get("base") not in (None, self.base.to_dict()):
            raise ValueError(
                f"checkpoint was trained on base {saved['base']}, not this target "
                f"({self.base.describe()})"
            )

    def export(self, path: str | Path, extra: dict[str, Any]) -> Path:
        """Write the heads in the core checkpoint format (``save_heads``), or, training a
        delta, the delta (``save_delta``)."""
        from selfspec.heads import save_heads

        if self.delta is not None:  # the delta alone, for the heads it corrects
            vocab = None if self.delta_vocab is None else self.delta_vocab.cpu()
            delta = Delta(self.delta, heads_hash(self.heads), delta_state(self.heads), vocab)
            return save_delta(delta, Path(path), extra=extra)
        return save_heads(self.heads, path, self.base, extra=extra)


def _final_norm(target: TargetForward) -> torch.nn.Module | None:
    """The target body's final norm (Llama-like ``norm``, GPT-2's ``ln_f``), if it has one."""
    return getattr(target.body, "norm", None) or getattr(target.body, "ln_f", None)


def bf16_arithmetic(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively (CUDA with bf16, or a CPU with oneDNN's
    bf16 support: AVX-512 BF16 or AMX), where bfloat16 autocast pays."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False
