"""EAGLE-3 training: the training-time test trains what drafting computes, K steps give K losses,
a short fit lowers the loss, the draft vocabulary comes from the data, stored layer states and
tapped ones train alike, bf16 autocast runs."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from selfspec.heads import EagleCache, HeadsConfig
from selfspec.heads.eagle3 import Eagle3Head
from selfspec.target import TargetSpec
from selfspec.train.datamodule import DistilledDataModule
from selfspec.train.eagle3_loss import TTTConfig, eagle3_loss, eagle3_unroll
from selfspec.train.losses import response_positions
from selfspec.train.module import HeadsModule, OptimConfig


def _random_head(vocab: int = 50, layers: tuple[int, ...] = (0, 1, 2)) -> Eagle3Head:
    config = HeadsConfig(
        kind="eagle3",
        hidden_size=32,
        vocab_size=vocab,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        target_layers=layers,
    )
    head = Eagle3Head(config)
    with torch.no_grad():
        for parameter in head.parameters():  # leave the identity init: make every path count
            parameter.normal_(0, 0.2)
    return head


def test_unrolled_steps_equal_incremental_chain_drafting() -> None:
    torch.manual_seed(0)
    head = _random_head()
    embed = nn.Embedding(50, 32)
    ids = torch.randint(0, 50, (2, 12))  # [B, L]
    states = torch.randn(2, 11, 3 * 32)  # [B, L-1, 3H] the target's g_0 .. g_10
    with torch.no_grad():
        steps = eagle3_unroll(head, embed, ids, states, steps=4)  # each [B, L-2, H]
        for j in (0, 4, 7):
            # As the drafter does: commit (g_i, x_{i+1}) for i <= j, then a chain of drafts
            # each reading the previous draft's output.
            cache = EagleCache()
            positions = torch.arange(1, j + 2).expand(2, -1)
            fused = head.fuse(states[:, : j + 1])
            out = head(embed(ids[:, 1 : j + 2]), fused, positions, cache=cache)
            node = out[:, -1:]  # [B, 1, H] the root's hidden state
            torch.testing.assert_close(node[:, 0], steps[0][:, j])
            for depth in (2, 3, 4):
                token = ids[:, j + depth : j + depth + 1]
                node = head(embed(token), node, torch.full((2, 1), j + depth), cache=cache)
                torch.testing.assert_close(node[:, 0], steps[depth - 1][:, j])


@pytest.mark.parametrize("labels", ["soft", "argmax"])
def test_k_unrolled_steps_give_k_losses_that_all_train(labels: str) -> None:
    torch.manual_seed(1)
    head = _random_head()
    embed = nn.Embedding(50, 32)
    lm_head = nn.Linear(32, 50, bias=False)
    ids = torch.randint(0, 50, (2, 16))
    states, features = torch.randn(2, 15, 96), torch.randn(2, 15, 32)
    mask = response_positions(torch.tensor([16, 13]), torch.tensor([3, 5]), 15)
    config = TTTConfig(steps=5, labels=labels)
    out = eagle3_loss(head, embed, ids, states, features, lm_head, mask, config)
    assert sorted(k for k in out.parts if k.startswith("loss_head")) == [
        f"loss_head{k}" for k in range(5)
    ]
    out.loss.backward()
    for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight"):
        assert head.get_parameter(name).grad.abs().sum() > 0, name
    assert embed.weight.grad is None  # the target's embedding stays frozen


def test_positions_whose_token_the_draft_cannot_propose_are_not_trained() -> None:
    torch.manual_seed(2)
    head = _random_head()
    ids = torch.randint(0, 50, (1, 10))
    states, features = torch.randn(1, 9, 96), torch.randn(1, 9, 32)
    mask = torch.ones(1, 9, dtype=torch.bool)
    head.t2d.zero_()  # no token is in the draft vocabulary
    out = eagle3_loss(
        head, nn.Embedding(50, 32), ids, states, features, nn.Linear(32, 50), mask, TTTConfig()
    )
    assert out.parts == {} and float(out.loss) == 0.0


def test_bad_ttt_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TTTConfig(steps=0)
    with pytest.raises(ValueError, match="labels must be"):
        TTTConfig(labels="hard")  # type: ignore[arg-type]


# -- the Lightning module ------------------------------------------------------------------------


def _fit(module: HeadsModule, data: Path, steps: int, root: Path, **trainer: object) -> L.Trainer:
    trainer_obj = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
        **trainer,  # type: ignore[arg-type]
    )
    trainer_obj.fit(
        module, datamodule=DistilledDataModule(str(data), batch_size=4, val_fraction=0.25)
    )
    return trainer_obj


def _val_loss(module: HeadsModule, data: Path) -> float:
    datamodule = DistilledDataModule(str(data), batch_size=8, val_fraction=0.25)
    datamodule.setup()
    module.eval()
    with torch.no_grad():
        losses = [module._loss(b).loss for b in datamodule.val_dataloader()]
    return float(torch.stack(losses).mean())


def test_short_fit_lowers_the_loss(tiny_target: Path, distilled: Path, tmp_path: Path) -> None:
    L.seed_everything(0)
    module = HeadsModule(
        TargetSpec(model=str(tiny_target)),
        kind="eagle3",
        ttt=TTTConfig(steps=3),
        optim=OptimConfig(lr=3e-3, warmup_steps=0),
    )
    assert module.heads.config.target_layers == (0, 1, 1)  # the tiny target has 2 layers
    # A new head's lm_head starts as the target's.
    assert torch.equal(module.heads.lm_head.weight, module.target.lm_head.weight)
    before = _val_loss(module, distilled)
    _fit(module, distilled, steps=30, root=tmp_path)
    after = _val_loss(module, distilled)
    assert after < 0.8 * before, (before, after)


def test_draft_vocabulary_comes_from_the_data(
    tiny_target: Path, distilled: Path, tmp_path: Path
) -> None:
    module = HeadsModule(
        TargetSpec(model=str(tiny_target)), kind="eagle3", loss_vocab_size=12, target_layers=[1, 2]
    )
    _fit(module, distilled, steps=2, root=tmp_path)
    heads = module.heads
    assert heads.config.draft_vocab_size == 12 and heads.lm_head.weight.shape == (12, 32)
    assert heads.config.target_layers == (1, 2)
    assert torch.equal(heads.draft_vocab, module.loss_vocab)
    assert torch.equal(heads.t2d.nonzero().flatten(), module.loss_vocab)
    assert 0 < module.loss_vocab_coverage <= 1


def test_stored_layer_states_train_like_tapped_ones(tiny_target: Path, distilled: Path) -> None:
    module = HeadsModule(TargetSpec(model=str(tiny_target)), kind="eagle3", ttt=TTTConfig(steps=2))
    datamodule = DistilledDataModule(str(distilled), batch_size=4, val_fraction=0)
    datamodule.setup()
    batch = next(iter(datamodule.train_dataloader()))
    module.eval()
    with torch.no_grad():
        tapped = module._loss(batch).loss
        layer_states, features = module._eagle3_inputs(batch)
        stored = {
            **batch,
            "layer_features": layer_states,
            "features": features,
            "layer_ids": torch.tensor([[0, 1, 1]] * 4),
        }
        torch.testing.assert_close(module._loss(stored).loss, tapped)
        wrong = {**stored, "layer_ids": torch.tensor([[0, 1, 2]] * 4)}
        with pytest.raises(
            ValueError, match=r"hold layers \[0, 1, 2\], the heads read \[0, 1, 1\]"
        ):
            module._loss(wrong)


def test_bf16_autocast_steps(tiny_target: Path, distilled: Path, tmp_path: Path) -> None:
    module = HeadsModule(
        TargetSpec(model=str(tiny_target)),
        kind="eagle3",
        ttt=TTTConfig(steps=2),
        bf16_autocast="on",
    )
    assert module._autocast_enabled
    trainer = _fit(module, distilled, steps=2, root=tmp_path, accumulate_grad_batches=2)
    assert trainer.global_step == 2
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert module.heads.fc.weight.dtype == torch.float32  # master weights stay float32


def test_eagle3_options_on_other_kinds_are_refused(tiny_target: Path) -> None:
    with pytest.raises(ValueError, match="options of kind eagle3 only"):
        HeadsModule(TargetSpec(model=str(tiny_target)), kind="eagle", ttt=TTTConfig())
    with pytest.raises(ValueError, match="does not fit the target"):
        HeadsModule(TargetSpec(model=str(tiny_target)), kind="eagle3", target_layers=[-1])
    with pytest.raises(ValueError, match=r"reach past the target's 2 decoder layers"):
        HeadsModule(TargetSpec(model=str(tiny_target)), kind="eagle3", target_layers=[1, 3])


def test_layer_states_stored_in_the_data_are_read(
    tiny_target: Path, distilled: Path, tmp_path: Path
) -> None:
    """A dataset with ``layer_features`` (float16, as a data engine would store them) and
    ``layer_ids`` trains without a target forward and gives the tapped loss up to rounding."""
    from datasets import Array2D, Dataset, Features, Sequence, Value

    from selfspec.drafting.taps import LayerTaps
    from selfspec.train.shards import SHARD_META, load_distilled

    module = HeadsModule(TargetSpec(model=str(tiny_target)), kind="eagle3", ttt=TTTConfig(steps=2))
    module.eval()
    rows = load_distilled(distilled).select(range(8))
    columns: dict[str, list] = {"input_ids": [], "prompt_len": [], "features": []}
    columns |= {"layer_features": [], "layer_ids": []}
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor(row["input_ids"])[None]  # [1, L]
            states, last = module._eagle3_inputs({"input_ids": ids})  # [1, L-1, 3H], [1, L-1, H]
            columns["input_ids"].append(row["input_ids"])
            columns["prompt_len"].append(row["prompt_len"])
            columns["features"].append(last[0].half().numpy())
            columns["layer_features"].append(states[0].half().numpy())
            columns["layer_ids"].append([0, 1, 1])
    schema = Features(
        {
            "input_ids": Sequence(Value("int32")),
            "prompt_len": Value("int32"),
            "features": Array2D(shape=(None, 32), dtype="float16"),
            "layer_features": Array2D(shape=(None, 96), dtype="float16"),
            "layer_ids": Sequence(Value("int32")),
        }
    )
    shard = tmp_path / "stored" / "shard-00000"
    Dataset.from_dict(columns, features=schema).save_to_disk(str(shard))
    (shard / SHARD_META).write_text('{"key": "test"}')

    datamodule = DistilledDataModule(str(tmp_path / "stored"), batch_size=4, val_fraction=0)
    datamodule.setup()
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["layer_features"].shape[-1] == 96 and batch["layer_ids"].tolist()[0] == [0, 1, 1]
    taps, module.taps = module.taps, None  # a target forward would fail now
    with torch.no_grad():
        from_data = module._loss(batch).loss
        module.taps = taps
        tapped = module._loss({k: batch[k] for k in ("input_ids", "lengths", "prompt_len")}).loss
    torch.testing.assert_close(from_data, tapped, rtol=2e-2, atol=2e-2)
    assert isinstance(taps, LayerTaps)


def test_continuing_exported_heads_keeps_their_vocabulary_and_layers(
    tiny_target: Path, distilled: Path, tmp_path: Path
) -> None:
    spec = TargetSpec(model=str(tiny_target))
    first = HeadsModule(spec, kind="eagle3", loss_vocab_size=12, ttt=TTTConfig(steps=2))
    _fit(first, distilled, steps=2, root=tmp_path)
    first.export(tmp_path / "heads", extra={})
    again = HeadsModule(spec, kind="eagle3", init_from=str(tmp_path / "heads"))
    _fit(again, distilled, steps=2, root=tmp_path)
    assert torch.equal(again.heads.draft_vocab, first.heads.draft_vocab)
    assert torch.equal(again.loss_vocab, first.heads.draft_vocab)
    with pytest.raises(ValueError, match="reads target layers"):
        HeadsModule(spec, kind="eagle3", init_from=str(tmp_path / "heads"), target_layers=[1])
    wrong = HeadsModule(spec, kind="eagle3", init_from=str(tmp_path / "heads"), loss_vocab_size=20)
    with pytest.raises(ValueError, match="draft from 12 tokens"):
        _fit(wrong, distilled, steps=1, root=tmp_path)
