"""Recalibration: heads fine-tuned for one adapter, saved beside it, measured before and after.

Heads trained on the base lose acceptance under an adapter that moves the target far from the
base (τ below the `selfspec eval --min-ratio` gate). Recalibration trains, on data self-distilled
from the target **with that adapter active**, a low-rank *delta* of those heads (default,
``--delta-rank 16``: ~4 % of their size, saved as ``<adapter>/heads-delta/``, applied on top of
the shared heads while the adapter's requests draft; see ``selfspec.heads.delta``), or with
``--delta-rank 0`` a full *copy* of them (``<adapter>/heads/``):

1. the adapter is made active through the store (`store.scope(name)`), and the target answers the
   first `--max-prompts` prompts (HF `generate`, through `selfspec.train.distill`); its last hidden
   states (and, for EAGLE-3 heads, its states entering their target layers) are captured during
   generation, so the training features are the adapted target's own;
2. the heads (`--heads`) are fine-tuned for `--max-steps` with the training losses and
   `HeadsModule` of `selfspec train`; the embedding and lm_head they draft through are the base's,
   which are the adapted target's too (adapters on them are refused by the store);
3. they are written atomically to `<adapter>/heads-delta/` (the delta and the hash of the heads
   it corrects) or `<adapter>/heads/` (the core checkpoint; the base fingerprint is the base
   model's), where the server finds them;
4. held-out prompts are decoded under the adapter with the old heads and the new ones (and the
   base with the old heads): τ before and after, acceptance per depth, speedup, and greedy
   equality with vanilla decoding under the adapter. The report also gives the heads' top-1
   agreement with the adapted target on distilled held-out rows (teacher-forced), before and after.

Outputs `recalibration.json` and `recalibration.md` in `--out`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from selfspec.adapters.prompts import default_prompts_file, encode_prompts, read_prompt_file
from selfspec.adapters.robustness import (
    BASE,
    EvalSettings,
    Measurement,
    machine,
    measure,
    with_ratios,
)
from selfspec.adapters.select import select_adapter
from selfspec.adapters.validate import HEADS_DIR
from selfspec.atomic import write_text_atomic
from selfspec.cli_args import parse_dataclass
from selfspec.generation import SpeculativeGenerator
from selfspec.heads import HeadKind, load_heads
from selfspec.heads.checkpoint import read_heads_config
from selfspec.heads.delta import DELTA_DIR, DeltaBank, DeltaConfig, load_delta
from selfspec.shipped import resolve_heads_dir
from selfspec.target import TargetSpec, load_target
from selfspec.train.datamodule import DistilledDataModule
from selfspec.train.distill import DistillConfig, distill
from selfspec.train.eagle3_loss import TTTConfig
from selfspec.train.losses import eagle_loss, medusa_loss, response_positions
from selfspec.train.module import HeadsModule, OptimConfig
from selfspec.train.prompts import OnBadLine, read_prompts
from selfspec.tree import parse_tree_spec

logger = logging.getLogger(__name__)

PROG = "selfspec recalibrate"
TRAIN_PROMPTS_FILE = "prompts.jsonl"


class HeadsExist(ValueError):
    """The adapter already carries heads and `--overwrite` was not given."""


@dataclass(frozen=True)
class RecalibrateConfig:
    """What to recalibrate, on what data, for how long, and how to measure it."""

    adapter: str = field(
        metadata={"help": "adapter name (under --adapters-root or the shipped examples) or dir"}
    )
    model: str | None = field(
        default=None, metadata={"help": "local HF model dir or .gguf; omit for the default"}
    )
    adapters_root: str | None = field(
        default=None, metadata={"help": "directory of adapter directories"}
    )
    heads: str = field(
        default="eagle",
        metadata={"help": "heads to start from: a heads dir, or 'eagle' / 'medusa' (shipped)"},
    )
    prompts: str | None = field(
        default=None,
        metadata={"help": "JSONL training prompts (default: train/data/prompts.jsonl)"},
    )
    max_prompts: int = field(default=64, metadata={"help": "first N training prompts"})
    max_new_tokens: int = field(
        default=96, metadata={"help": "longest distilled response, in tokens"}
    )
    heldout_prompts: str | None = field(
        default=None,
        metadata={"help": "JSONL held-out prompts (default: train/data/prompts_heldout.jsonl)"},
    )
    eval_prompts: int = field(default=8, metadata={"help": "first N held-out prompts"})
    eval_max_new_tokens: int = field(
        default=64, metadata={"help": "tokens generated per held-out prompt for tau"}
    )
    max_steps: int | None = field(
        default=None,
        metadata={
            "help": "optimizer steps of the fine-tuning; default 150 for a delta, 60 for a full "
            "copy"
        },
    )
    batch_size: int = field(default=8, metadata={"help": "rows per training batch"})
    lr: float | None = field(
        default=None,
        metadata={
            "help": "peak learning rate (AdamW); default 3e-3 for a delta (its B starts at 0), "
            "3e-4 for a full copy"
        },
    )
    warmup_steps: int = field(default=5, metadata={"help": "linear warmup steps"})
    eagle_depth: int = field(
        default=2,
        metadata={
            "help": "draft depths simulated per training step (EAGLE's depth; EAGLE-3's "
            "training-time test steps: the shared heads trained all 7, a delta corrects the "
            "first ones at a fraction of the time)"
        },
    )
    loss_vocab_size: int | None = field(
        default=8192,
        metadata={
            "help": "a full copy: losses (and its draft vocabulary) over this many most frequent "
            "response tokens (0: all); a delta drafts from the shared heads' vocabulary plus "
            "the adapter's own tokens"
        },
    )
    tree: str = field(default="auto", metadata={"help": "tree spec, as for selfspec generate"})
    dtype: str = field(default="float32", metadata={"help": "float32 or bfloat16 (measurement)"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads"})
    out: str = field(default="recalibration", metadata={"help": "report directory"})
    overwrite: bool = field(
        default=False, metadata={"help": "replace heads the adapter already carries"}
    )
    seed: int = field(default=0, metadata={"help": "seed of data order and training"})
    delta_rank: int = field(
        default=16,
        metadata={
            "help": "train a rank-N delta of the shared heads, saved as <adapter>/heads-delta/ "
            "(~4 %% of the heads at 16); 0: a full copy of the heads, <adapter>/heads/"
        },
    )

    @property
    def steps(self) -> int:
        """``max_steps``, or the default for what is trained: a delta learns through its
        low-rank pairs only and needs more steps (`shout`, lr 3e-3, its own vocabulary: τ 1.78
        after 60 steps, 1.97 after 150, ~7 CPU-minutes in all; a full copy 1.91 after 60)."""
        if self.max_steps is not None:
            return self.max_steps
        return 150 if self.delta_rank else 60

    @property
    def learning_rate(self) -> float:
        """``lr``, or the default for what is trained. A delta's low-rank pairs start from zero
        and move the heads far less per step than a full copy's weights: on the default model's
        `shout` adapter (60 steps, rank 16) τ rose 1.08 -> 1.23 at 3e-4, -> 1.56 at 3e-3 and
        -> 1.46 at 1e-2 (a full copy at 3e-4: 1.91)."""
        if self.lr is not None:
            return self.lr
        return 3e-3 if self.delta_rank else 3e-4

    def __post_init__(self) -> None:
        parse_tree_spec(self.tree)
        for name in ("max_prompts", "eval_prompts", "batch_size", "eagle_depth"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.steps}")
        for name in ("max_new_tokens", "eval_max_new_tokens"):
            if getattr(self, name) < 2:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 2, got {getattr(self, name)}"
                )
        if (self.lr is not None and not self.lr > 0) or self.warmup_steps < 0:
            raise ValueError(
                f"need --lr > 0 and --warmup-steps >= 0, got {self.lr}, {self.warmup_steps}"
            )
        if not 0 <= self.delta_rank <= 256:
            raise ValueError(f"--delta-rank must be in [0, 256], got {self.delta_rank}")
        if self.loss_vocab_size is not None and self.loss_vocab_size < 0:
            raise ValueError(f"--loss-vocab-size must be >= 0, got {self.loss_vocab_size}")


@dataclass(frozen=True)
class Agreement:
    """The heads against the adapted target on distilled rows, teacher-forced, whole vocabulary."""

    loss: float
    """The training loss (see `selfspec.train.losses`), averaged over response positions."""
    top1: float
    """Share of positions where the first draft token is the adapted target's greedy token."""
    top5: float


@dataclass(frozen=True)
class RecalibrationReport:
    adapter: str
    heads_from: str
    heads_path: str
    rows: tuple[Measurement, ...]
    """Base with the old heads; the adapter with the old heads (before), with the new (after)."""
    train_before: Agreement
    train_after: Agreement
    heldout_before: Agreement
    heldout_after: Agreement
    losses: tuple[float, ...]
    """Training loss of every optimizer step."""
    settings: dict[str, Any]

    @property
    def before(self) -> Measurement:
        return self.rows[1]

    @property
    def after(self) -> Measurement:
        return self.rows[2]

    @property
    def lossless(self) -> bool:
        return all(row.lossless for row in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "adapter": self.adapter,
            "heads_from": self.heads_from,
            "heads_path": self.heads_path,
            "tau_before": round(self.before.tau, 4),
            "tau_after": round(self.after.tau, 4),
            "rows": [row.to_dict() for row in self.rows],
            "agreement": {
                "train_before": asdict(self.train_before),
                "train_after": asdict(self.train_after),
                "heldout_before": asdict(self.heldout_before),
                "heldout_after": asdict(self.heldout_after),
            },
            "losses": [round(x, 5) for x in self.losses],
            "settings": self.settings,
        }

    def to_markdown(self) -> str:
        lines = [
            f"Recalibration of the heads for adapter `{self.adapter}` "
            f"(from `{self.heads_from}`, saved to `{self.heads_path}`).",
            "",
            "| target | heads | τ | τ / τ base | acc@1 | acc@2 | tok/s vanilla | "
            "tok/s speculative | speedup | greedy equal |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in self.rows:
            rates = [*row.acceptance_by_depth[:2], None, None][:2]
            lines.append(
                f"| {row.name} | {row.heads} | {row.tau:.2f} | "
                f"{row.tau_ratio:.2f} | "
                + "".join("- | " if r is None else f"{r:.2f} | " for r in rates)
                + f"{row.vanilla_tps:.1f} | {row.speculative_tps:.1f} | {row.speedup:.2f}x | "
                f"{row.greedy_equal}/{row.prompts} |"
            )
        lines += [
            "",
            "Heads vs the adapted target, teacher-forced on distilled rows (whole vocabulary; "
            "EAGLE-3 heads: their draft vocabulary):",
            "",
            "| rows | loss before | loss after | top-1 before | top-1 after |",
            "|---|---|---|---|---|",
        ]
        for label, before, after in (
            ("training", self.train_before, self.train_after),
            ("held-out", self.heldout_before, self.heldout_after),
        ):
            lines.append(
                f"| {label} | {before.loss:.4f} | {after.loss:.4f} | {before.top1:.1%} | "
                f"{after.top1:.1%} |"
            )
        settings = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return "\n".join(lines) + f"\n\nMeasured with {settings}.\n"


def recalibrate(config: RecalibrateConfig) -> RecalibrationReport:
    """Fine-tune heads for `config.adapter`, save them to `<adapter>/heads/`, measure τ."""
    started = time.perf_counter()
    is_default = config.model in (None, "default")
    spec = TargetSpec(model=config.model, dtype=config.dtype, threads=config.threads)
    target = load_target(spec)
    model, tokenizer = target.model, target.tokenizer
    store, name, scope = select_adapter(model, config.adapter, config.adapters_root, is_default)
    delta = DeltaConfig(rank=config.delta_rank) if config.delta_rank else None
    destination = store.info(name).path / (DELTA_DIR if delta else HEADS_DIR)
    _refuse_existing(destination, config.overwrite)
    heads_dir = _heads_dir(config.heads, is_default)
    old_heads = load_heads(heads_dir, model)  # refuses heads of another base
    kind = read_heads_config(heads_dir)[0].kind
    # EAGLE-3 heads read the adapted target's states at their layers too: tapped while it answers.
    tap_layers = tuple(old_heads.config.target_layers or ()) if kind is HeadKind.EAGLE3 else ()
    train_file = Path(config.prompts) if config.prompts else train_prompts_file()
    heldout_file = (
        Path(config.heldout_prompts) if config.heldout_prompts else default_prompts_file()
    )
    eval_ids = encode_prompts(tokenizer, read_prompt_file(heldout_file, config.eval_prompts))

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    # Fresh every run: distill resumes shards by a key that knows the base, not the adapter.
    work = Path(tempfile.mkdtemp(prefix=".recalibrate-", dir=out))
    try:
        # 1. the adapted target's own answers and features
        distilled = {}
        for part, source, limit in (
            ("train", train_file, config.max_prompts),
            ("heldout", heldout_file, config.eval_prompts),
        ):
            prompts = first_prompts(source, limit, work / f"{part}.jsonl")
            distil_config = DistillConfig(
                prompts=str(prompts),
                output=str(work / part),
                target=spec,
                max_new_tokens=config.max_new_tokens,
                batch_size=min(16, limit),
                shard_size=max(limit, 1),
                store_features=True,
                tap_layers=tap_layers,
                on_bad_line=OnBadLine.skip,
            )
            with scope():  # the adapter is active for every forward of the generation
                distill(distil_config, target)
            distilled[part] = work / part

        # 2. fine-tune a copy of the heads on them
        module = HeadsModule(
            target=TargetSpec(model=config.model, dtype="float32", threads=config.threads),
            kind=kind.value,
            init_from=str(heads_dir),
            loss_vocab_size=config.loss_vocab_size or None,
            optim=OptimConfig(lr=config.learning_rate, warmup_steps=config.warmup_steps),
            eagle_depth=config.eagle_depth,
            ttt=recalibration_ttt(kind, config.eagle_depth),
            delta=delta,
        )
        data = DistilledDataModule(
            train_data=str(distilled["train"]),
            val_data=str(distilled["heldout"]),
            batch_size=config.batch_size,
            seed=config.seed,
        )
        data.setup("fit")
        train_rows = DataLoader(
            data.train_set, batch_size=config.batch_size, collate_fn=data.collate
        )
        heldout_rows = DataLoader(
            data.val_set, batch_size=config.batch_size, collate_fn=data.collate
        )
        train_before, heldout_before = (
            agreement(module, train_rows),
            agreement(module, heldout_rows),
        )
        losses = fit_for_steps(module, data, config.steps, config.seed)
        train_after, heldout_after = agreement(module, train_rows), agreement(module, heldout_rows)

        # 3. save beside the adapter (atomic; the store and `selfspec eval` pick it up)
        _refuse_existing(destination, config.overwrite)
        record = {
            "recalibrated_for": name,
            "adapter_path": _portable(store.info(name).path),
            "heads_from": _portable(heads_dir),
            "steps": len(losses),
            "distilled_prompts": config.max_prompts,
            "max_new_tokens": config.max_new_tokens,
            "lr": config.learning_rate,
            "eagle_depth": config.eagle_depth,
            "loss_vocab_size": config.loss_vocab_size,
            "heldout_top1_before": round(heldout_before.top1, 5),
            "heldout_top1_after": round(heldout_after.top1, 5),
        }
        if delta is not None:
            record["delta_rank"] = delta.rank
        module.export(destination, extra=record)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    # 4. τ before and after, under the adapter, on held-out prompts
    new_scope = scope
    if delta is None:
        new_heads = load_heads(destination, model)
    else:  # the shared heads with the adapter's delta active while it drafts
        new_heads = load_heads(heads_dir, model)
        bank = DeltaBank(new_heads)
        bank.add(name, load_delta(destination, new_heads))

        @contextlib.contextmanager
        def new_scope() -> Iterator[None]:
            with scope(), bank.active(name):
                yield

    settings = EvalSettings(
        max_new_tokens=config.eval_max_new_tokens, tree=parse_tree_spec(config.tree)
    )
    old_generator = SpeculativeGenerator(model, old_heads, tokenizer)
    new_generator = SpeculativeGenerator(model, new_heads, tokenizer)
    rows = [measure(old_generator, eval_ids, settings, scope=store.scope(None), name=BASE)]
    with store.pinned(name):
        rows.append(measure(old_generator, eval_ids, settings, scope=scope, name=name))
        rows.append(
            measure(new_generator, eval_ids, settings, scope=new_scope, name=name, heads="own")
        )
    return RecalibrationReport(
        adapter=name,
        heads_from=config.heads if config.heads in ("eagle", "medusa") else str(heads_dir),
        heads_path=str(destination),
        rows=with_ratios(rows),
        train_before=train_before,
        train_after=train_after,
        heldout_before=heldout_before,
        heldout_after=heldout_after,
        losses=tuple(losses),
        settings={
            "target": target.name,
            "dtype": config.dtype,
            "training_dtype": "float32",
            "train_prompts": f"{train_file.name} (first {config.max_prompts})",
            "heldout_prompts": f"{heldout_file.name} (first {len(eval_ids)})",
            "max_new_tokens": config.max_new_tokens,
            "eval_max_new_tokens": config.eval_max_new_tokens,
            "max_steps": config.steps,
            "batch_size": config.batch_size,
            "lr": config.learning_rate,
            "tree": config.tree,
            "seconds": round(time.perf_counter() - started, 1),
            **machine(),
        },
    )


def recalibration_ttt(kind: HeadKind, depth: int) -> TTTConfig | None:
    """EAGLE-3 heads' training-time test when recalibrating: ``depth`` unrolled steps (None for
    other heads, which take ``eagle_depth``)."""
    return TTTConfig(steps=depth) if kind is HeadKind.EAGLE3 else None


@torch.no_grad()
def agreement(module: HeadsModule, rows: DataLoader) -> Agreement:
    """The heads' loss and top-1/top-5 agreement with the target over `rows`, per position.

    Over the whole vocabulary (not the training's loss vocabulary), so before and after compare;
    EAGLE-3 heads over their own draft vocabulary (a delta keeps it: both sides see the same)."""
    heads = module.heads
    was_training = heads.training
    heads.eval()
    sums = {"loss": 0.0, "top1": 0.0, "top5": 0.0}
    positions = 0.0
    for batch in rows:
        features = batch["features"].to(module.target.dtype)  # [B, L-1, H]
        mask = response_positions(batch["lengths"], batch["prompt_len"], features.shape[1])
        if module.kind is HeadKind.EAGLE3:  # over its own draft vocabulary, which a delta keeps
            out = module.heads_loss(batch)
        elif module.kind is HeadKind.MEDUSA:
            out = medusa_loss(heads, module.target.lm_head, features, mask, module.loss_weights)
        else:
            out = eagle_loss(
                heads,
                module.target.embed,
                module.target.lm_head,
                batch["input_ids"],
                features,
                mask,
                module.loss_weights,
                module.eagle_depth,
            )
        count = float(mask.sum())
        positions += count
        sums["loss"] += count * float(out.loss)
        sums["top1"] += count * float(out.parts.get("top1_head0", 0.0))
        sums["top5"] += count * float(out.parts.get("top5_head0", 0.0))
    heads.train(was_training)
    return Agreement(**{k: round(v / max(positions, 1.0), 5) for k, v in sums.items()})


class _LossHistory(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def fit_for_steps(
    module: HeadsModule, data: DistilledDataModule, steps: int, seed: int
) -> list[float]:
    """Train ``module`` on ``data`` for ``steps`` optimizer steps (float32, no checkpoints, no
    validation); the loss of every step."""
    history = _LossHistory()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=steps,
        max_epochs=-1,
        gradient_clip_val=module.optim.grad_clip,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[history],
    )
    with torch.random.fork_rng(devices=[]):  # data order; the caller's RNG is left alone
        torch.manual_seed(seed)
        trainer.fit(module, datamodule=data)
    module.heads.eval()
    return history.losses


def _refuse_existing(destination: Path, overwrite: bool) -> None:
    if destination.exists() and not overwrite:
        raise HeadsExist(
            f"adapter heads {destination} already exist; pass --overwrite to replace them"
        )


def _heads_dir(spec: str, is_default: bool) -> Path:
    path = resolve_heads_dir(spec, is_default)
    if not path.is_dir():
        raise FileNotFoundError(f"--heads {spec!r} is neither 'eagle', 'medusa' nor a directory")
    return path


def train_prompts_file() -> Path:
    path = Path(__file__).parent / "data" / TRAIN_PROMPTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the default training prompts {path} are missing; pass --prompts")
    return path


def first_prompts(source: Path, limit: int, destination: Path) -> Path:
    """The first `limit` usable prompts of `source`, as a JSONL file (distill reads whole files)."""
    records, _ = read_prompts(source, OnBadLine.skip)
    lines = []
    for record in records[:limit]:
        key = "prompt" if isinstance(record.prompt, str) else "messages"
        lines.append(json.dumps({key: record.prompt}) + "\n")
    destination.write_text("".join(lines))
    return destination


def write_report(report: RecalibrationReport, out: Path) -> list[Path]:
    return [
        write_text_atomic(
            out / "recalibration.json", json.dumps(report.to_dict(), indent=2) + "\n"
        ),
        write_text_atomic(out / "recalibration.md", report.to_markdown()),
    ]


DESCRIPTION = (
    "Fine-tune a copy of the heads on data self-distilled from the target with ADAPTER active, "
    "save them as <adapter>/heads/, and measure tau under the adapter before and after (with "
    "greedy equality against vanilla decoding). Writes recalibration.json and recalibration.md "
    "into --out. Exit 0 on success, 1 if an output was not lossless, 2 on bad input."
)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_dataclass(
        RecalibrateConfig, sys.argv[1:] if argv is None else argv, DESCRIPTION, PROG
    )
    from selfspec.heads import HeadsCheckpointError
    from selfspec.target import TargetLoadError
    from selfspec.train.memory import MemoryBudgetError
    from selfspec.train.shards import DistilledDataError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = recalibrate(config)
    except (
        FileNotFoundError,
        ValueError,
        TargetLoadError,
        HeadsCheckpointError,
        MemoryBudgetError,
        DistilledDataError,
    ) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    written = write_report(report, Path(config.out))
    print(report.to_markdown())
    print(
        f"tau under {report.adapter}: {report.before.tau:.2f} before -> {report.after.tau:.2f} "
        f"after; heads saved to {report.heads_path}; wrote " + ", ".join(str(p) for p in written),
        file=sys.stderr,
    )
    if not report.lossless:
        mismatched = {
            f"{r.name} ({r.heads})": list(r.mismatched_prompts)
            for r in report.rows
            if not r.lossless
        }
        print(f"{PROG}: NOT LOSSLESS: {mismatched}", file=sys.stderr)
        return 1
    return 0


def _portable(path: Path) -> str:
    """`path` relative to the working directory when it lies below it (records stay portable)."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(resolved)
