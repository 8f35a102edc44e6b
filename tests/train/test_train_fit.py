"""`selfspec train`: loss goes down, export loads on its base only, resume, heads-only state."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from selfspec.fingerprint import FingerprintMismatch
from selfspec.heads import load_heads
from selfspec.target import TargetSpec, load_target
from selfspec.train.cli import train_main
from selfspec.train.datamodule import DistilledDataModule
from selfspec.train.module import HeadsModule, OptimConfig
from selfspec.train.shards import DistilledDataError


def fit(module: HeadsModule, data: Path, steps: int, root: Path, **trainer: object) -> L.Trainer:
    trainer_obj = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
        **trainer,  # type: ignore[arg-type]
    )
    datamodule = DistilledDataModule(str(data), batch_size=4, val_fraction=0.25)
    trainer_obj.fit(module, datamodule=datamodule)
    return trainer_obj


def val_loss(module: HeadsModule, data: Path) -> float:
    datamodule = DistilledDataModule(str(data), batch_size=8, val_fraction=0.25)
    datamodule.setup()
    module.eval()
    with torch.no_grad():
        losses = [module._loss(b).loss for b in datamodule.val_dataloader()]
    return float(torch.stack(losses).mean())


@pytest.mark.parametrize(("kind", "eagle_depth"), [("eagle", 1), ("eagle", 3), ("medusa", 1)])
def test_short_fit_lowers_the_loss(
    kind: str, eagle_depth: int, tiny_target: Path, distilled: Path, tmp_path: Path
) -> None:
    L.seed_everything(0)
    module = HeadsModule(
        TargetSpec(model=str(tiny_target)),
        kind=kind,
        num_heads=3,
        eagle_depth=eagle_depth,
        optim=OptimConfig(lr=3e-3, warmup_steps=0),
    )
    before = val_loss(module, distilled)
    fit(module, distilled, steps=30, root=tmp_path, enable_checkpointing=False)
    assert val_loss(module, distilled) < 0.8 * before


def test_loss_vocabulary_restricts_the_projection(
    tiny_target: Path, distilled: Path, tmp_path: Path
) -> None:
    module = HeadsModule(
        TargetSpec(model=str(tiny_target)), kind="medusa", num_heads=2, loss_vocab_size=10
    )
    fit(module, distilled, steps=2, root=tmp_path, enable_checkpointing=False)
    assert module.loss_vocab is not None and module.loss_vocab.shape == (10,)
    assert 0 < module.loss_vocab_coverage <= 1
    assert module._projection()(torch.zeros(3, 32)).shape == (3, 10)
    # The heads draft from exactly that vocabulary, and export it.
    assert module.heads.config.draft_vocab_size == 10
    assert torch.equal(module.heads.draft_vocab, module.loss_vocab)


def test_only_head_parameters_train_and_checkpoint(
    tiny_target: Path, distilled: Path, tmp_path: Path
) -> None:
    module = HeadsModule(TargetSpec(model=str(tiny_target)), kind="eagle")
    names = [n for n, _ in module.named_parameters()]
    assert names and all(n.startswith("heads.") for n in names)
    assert not any(p.requires_grad for p in module.target.model.parameters())
    trainer = fit(module, distilled, steps=2, root=tmp_path)
    checkpoint = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)
    assert set(checkpoint["state_dict"]) == {f"heads.{k}" for k in module.heads.state_dict()}


def test_resume_continues_the_step_count(
    tiny_target: Path, distilled: Path, tmp_path: Path
) -> None:
    spec = TargetSpec(model=str(tiny_target))
    callback = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=3
    )
    first = fit(
        HeadsModule(spec, kind="medusa", num_heads=2), distilled, 3, tmp_path, callbacks=[callback]
    )
    assert first.global_step == 3
    resumed = HeadsModule(spec, kind="medusa", num_heads=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=5,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
    )
    datamodule = DistilledDataModule(str(distilled), batch_size=4, val_fraction=0.25)
    trainer.fit(resumed, datamodule=datamodule, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert trainer.global_step == 5


def test_cli_exports_heads_that_load_on_their_base_only(
    tiny_target: Path, other_target: Path, distilled: Path, tmp_path: Path
) -> None:
    out = tmp_path / "heads"
    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text('{"prompt": "tell me about owls"}\n')
    args = [
        "--model.target.model",
        str(tiny_target),
        "--model.kind",
        "eagle",
        "--data.train_data",
        str(distilled),
        "--data.batch_size",
        "4",
        "--trainer.max_steps",
        "3",
        "--trainer.accelerator",
        "cpu",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
        "--export.output_dir",
        str(out),
        "--export.tau_prompts",
        str(prompts),
        "--export.tau_num_prompts",
        "1",
        "--export.tau_max_new_tokens",
        "6",
    ]
    assert train_main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["global_step"] == 3
    assert set(metrics["tau"]["greedy"]) == {"dynamic", "static"}
    assert metrics["tau"]["greedy"]["dynamic"]["tau"] >= 1.0
    assert json.loads((out / "config.json").read_text())["extra"]["kind"] == "eagle"
    assert load_heads(out, load_target(TargetSpec(model=str(tiny_target))).model) is not None
    with pytest.raises(FingerprintMismatch, match="weights_hash"):
        load_heads(out, load_target(TargetSpec(model=str(other_target))).model)


def test_bad_configs_are_clear_errors(
    tiny_target: Path, other_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="does not fit the target"):
        HeadsModule(TargetSpec(model=str(tiny_target)), kind="medusa", num_heads=0)
    other = HeadsModule(TargetSpec(model=str(other_target)), kind="eagle")
    other.export(tmp_path / "other-heads", extra={})
    with pytest.raises(FingerprintMismatch):
        HeadsModule(TargetSpec(model=str(tiny_target)), init_from=str(tmp_path / "other-heads"))
    (tmp_path / "empty").mkdir()
    args = [
        "--model.target.model",
        str(tiny_target),
        "--data.train_data",
        str(tmp_path / "empty"),
        "--export.output_dir",
        str(tmp_path / "out"),
        "--trainer.accelerator",
        "cpu",
        "--trainer.logger",
        "false",
    ]
    assert train_main(args) == 2
    assert "empty has no finished shard" in capsys.readouterr().err
    with pytest.raises(DistilledDataError):
        DistilledDataModule(str(tmp_path / "empty")).setup()


def test_several_distilled_directories_train_as_one(distilled: Path) -> None:
    one = DistilledDataModule(str(distilled), val_fraction=0)
    one.setup()
    both = DistilledDataModule([str(distilled), str(distilled)], val_fraction=0)
    both.setup()
    assert len(both.train_set) == 2 * len(one.train_set)
    assert torch.equal(both.response_token_counts(101), 2 * one.response_token_counts(101))
    with pytest.raises(DistilledDataError, match="names no distilled directory"):
        DistilledDataModule([]).setup()
