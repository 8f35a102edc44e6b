"""Heads checkpoints: round trip, base fingerprint check, corrupt files, atomic writes."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model
from transformers import PreTrainedModel

import selfspec.heads.checkpoint as checkpoint_module
from selfspec.fingerprint import FingerprintMismatch, fingerprint_of
from selfspec.heads import (
    EagleHead,
    HeadsCheckpointError,
    MedusaHeads,
    build_heads,
    heads_config_for,
    load_heads,
    save_heads,
)
from selfspec.heads.checkpoint import read_heads_config
from selfspec.heads.draft_vocab import set_draft_vocab

KINDS = ["medusa", "eagle"]


@pytest.fixture(scope="module")
def base() -> PreTrainedModel:
    return make_tiny_model("llama", seed=0)


def _perturbed_heads(model: PreTrainedModel, kind: str, seed: int = 0) -> torch.nn.Module:
    """Heads with every parameter moved off its (identity) init, so outputs tell heads apart."""
    heads = build_heads(heads_config_for(model, kind, num_heads=3))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in heads.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return heads.eval()


def _outputs(heads: torch.nn.Module, model: PreTrainedModel) -> torch.Tensor:
    generator = torch.Generator().manual_seed(42)
    features = torch.randn(1, 5, heads.config.hidden_size, generator=generator)  # [1, S, H]
    with torch.no_grad():
        if isinstance(heads, MedusaHeads):
            return heads(features)  # [1, S, K, H]
        assert isinstance(heads, EagleHead)
        tokens = torch.tensor([[3, 14, 15, 92, 65]])
        embeds = model.get_input_embeddings()(tokens)  # [1, S, H]
        return heads(embeds, features, torch.arange(1, 6)[None])  # [1, S, H]


def _save(model: PreTrainedModel, path: Path, kind: str = "medusa", seed: int = 0) -> Path:
    return save_heads(_perturbed_heads(model, kind, seed), path, fingerprint_of(model))


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# -- round trip ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_gives_identical_outputs(
    base: PreTrainedModel, tmp_path: Path, kind: str
) -> None:
    heads = _perturbed_heads(base, kind)
    path = save_heads(heads, tmp_path / "heads", fingerprint_of(base), extra={"loss": 1.25})
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_heads(path, target=base)
    assert type(loaded) is type(heads)
    assert loaded.config == heads.config
    assert not loaded.training
    assert not any(p.requires_grad for p in loaded.parameters())
    assert torch.equal(_outputs(loaded, base), _outputs(heads, base))
    # A freshly built (unperturbed) set of heads differs: the comparison has teeth.
    fresh = build_heads(heads.config).eval()
    assert not torch.equal(_outputs(fresh, base), _outputs(heads, base))
    config, fingerprint, extra = read_heads_config(path)
    assert config == heads.config
    assert fingerprint == fingerprint_of(base)
    assert extra == {"loss": 1.25}


def test_load_with_dtype_follows_it(base: PreTrainedModel, tmp_path: Path) -> None:
    path = _save(base, tmp_path / "heads")
    loaded = load_heads(path, target=base, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())


# -- wrong base ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "seed"), [("llama", 1), ("qwen2", 0)], ids=["other-seed", "other-arch"]
)
def test_loading_onto_another_base_names_both_fingerprints(
    base: PreTrainedModel, tmp_path: Path, arch: str, seed: int
) -> None:
    path = _save(base, tmp_path / "heads")
    other = make_tiny_model(arch, seed=seed)
    with pytest.raises(FingerprintMismatch) as caught:
        load_heads(path, target=other)
    message = str(caught.value)
    assert fingerprint_of(base).describe() in message
    assert fingerprint_of(other).describe() in message
    assert str(path) in message


# -- corrupt or missing files --------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(HeadsCheckpointError, match="not a directory"):
        load_heads(tmp_path / "nowhere")


def test_missing_config(base: PreTrainedModel, tmp_path: Path) -> None:
    path = _save(base, tmp_path / "heads")
    (path / "config.json").unlink()
    with pytest.raises(HeadsCheckpointError, match="config.json"):
        load_heads(path, target=base)


def test_malformed_json(base: PreTrainedModel, tmp_path: Path) -> None:
    path = _save(base, tmp_path / "heads")
    (path / "config.json").write_text('{"format": "selfspec-heads", ')
    with pytest.raises(HeadsCheckpointError, match="config.json.*not valid JSON"):
        load_heads(path, target=base)


def test_binary_garbage_config(base: PreTrainedModel, tmp_path: Path) -> None:
    path = _save(base, tmp_path / "heads")
    (path / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(HeadsCheckpointError, match="config.json"):
        load_heads(path, target=base)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda c: c.update(format="something-else"), "format"),
        (lambda c: c.update(version=99), "version"),
        (lambda c: c["heads"].update(num_heads=0), "num_heads"),
        (lambda c: c["heads"].update(bogus=1), "bogus"),
        (lambda c: c.pop("base"), "base"),
        (lambda c: c["base"].pop("weights_hash"), "weights_hash"),
    ],
    ids=["format", "version", "invalid-field", "unknown-field", "no-base", "base-missing-key"],
)
def test_wrong_config_content(
    base: PreTrainedModel, tmp_path: Path, edit: Callable[[dict], object], needle: str
) -> None:
    path = _save(base, tmp_path / "heads")
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsCheckpointError) as caught:
        load_heads(path, target=base)
    message = str(caught.value)
    assert "config.json" in message and needle in message


def test_config_that_is_not_an_object(base: PreTrainedModel, tmp_path: Path) -> None:
    path = _save(base, tmp_path / "heads")
    (path / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(HeadsCheckpointError, match="config.json"):
        load_heads(path, target=base)


def test_missing_weights(base: PreTrainedModel, tmp_path: Path) -> None:
    path = _save(base, tmp_path / "heads")
    (path / "model.safetensors").unlink()
    with pytest.raises(HeadsCheckpointError, match="model.safetensors"):
        load_heads(path, target=base)


@pytest.mark.parametrize("keep", [0.5, 0.01, 0.0], ids=["half", "header-cut", "empty"])
def test_truncated_weights(base: PreTrainedModel, tmp_path: Path, keep: float) -> None:
    path = _save(base, tmp_path / "heads")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(HeadsCheckpointError, match="model.safetensors"):
        load_heads(path, target=base)


def test_garbage_weights(base: PreTrainedModel, tmp_path: Path) -> None:
    path = _save(base, tmp_path / "heads")
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header!!!!")
    with pytest.raises(HeadsCheckpointError, match="model.safetensors"):
        load_heads(path, target=base)


@pytest.mark.parametrize("kind", KINDS)
def test_weights_not_matching_config(base: PreTrainedModel, tmp_path: Path, kind: str) -> None:
    path = _save(base, tmp_path / "heads", kind=kind)
    config = json.loads((path / "config.json").read_text())
    config["heads"]["num_layers"] = 2  # the weights hold one layer / block per head
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsCheckpointError, match="model.safetensors.*does not match"):
        load_heads(path, target=base)


# -- atomic writes -------------------------------------------------------------------------------


def test_save_leaves_no_temporary_directories(base: PreTrainedModel, tmp_path: Path) -> None:
    _save(base, tmp_path / "heads")
    _save(base, tmp_path / "heads", seed=1)  # overwrite
    assert _leftovers(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["heads"]


def test_overwrite_replaces_the_checkpoint(base: PreTrainedModel, tmp_path: Path) -> None:
    path = tmp_path / "heads"
    _save(base, path, kind="medusa")
    second = _perturbed_heads(base, "eagle", seed=3)
    save_heads(second, path, fingerprint_of(base))
    loaded = load_heads(path, target=base)
    assert isinstance(loaded, EagleHead)
    assert torch.equal(_outputs(loaded, base), _outputs(second, base))


def test_failed_write_keeps_the_old_checkpoint(
    base: PreTrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "heads"
    first = _perturbed_heads(base, "medusa", seed=0)
    save_heads(first, path, fingerprint_of(base))

    def broken_save_file(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "save_file", broken_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_heads(_perturbed_heads(base, "medusa", seed=1), path, fingerprint_of(base))
    assert _leftovers(tmp_path) == []
    assert torch.equal(_outputs(load_heads(path, target=base), base), _outputs(first, base))


def test_failed_swap_keeps_the_old_checkpoint(
    base: PreTrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new directory is complete, but moving it into place fails (e.g. EACCES, EXDEV):
    the old checkpoint must still be at `path`, not stranded in a hidden directory."""
    path = tmp_path / "heads"
    first = _perturbed_heads(base, "medusa", seed=0)
    save_heads(first, path, fingerprint_of(base))
    real_rename = os.rename

    def rename(src: str | Path, dst: str | Path) -> None:
        if Path(dst) == path and Path(src).name.startswith(".heads."):
            raise OSError("rename refused")
        return real_rename(src, dst)

    monkeypatch.setattr(checkpoint_module.os, "rename", rename)
    with pytest.raises(OSError, match="rename refused"):
        save_heads(_perturbed_heads(base, "medusa", seed=1), path, fingerprint_of(base))
    monkeypatch.undo()
    assert torch.equal(_outputs(load_heads(path, target=base), base), _outputs(first, base))
    assert _leftovers(tmp_path) == []


# -- draft vocabulary ----------------------------------------------------------------------------


def _vocab_heads(model: PreTrainedModel, kind: str, ids: list[int]) -> torch.nn.Module:
    heads = build_heads(heads_config_for(model, kind, num_heads=3, draft_vocab_size=len(ids)))
    set_draft_vocab(heads, torch.tensor(ids))
    return heads


@pytest.mark.parametrize("kind", KINDS)
def test_draft_vocabulary_round_trips_as_integers(
    base: PreTrainedModel, tmp_path: Path, kind: str
) -> None:
    ids = [40, 2, 7, 99, 13]
    save_heads(_vocab_heads(base, kind, ids), tmp_path / "h", fingerprint_of(base))
    loaded = load_heads(tmp_path / "h", base)
    assert loaded.draft_vocab.dtype == torch.long
    assert loaded.draft_vocab.tolist() == sorted(ids)
    assert read_heads_config(tmp_path / "h")[0].draft_vocab_size == len(ids)


@pytest.mark.parametrize(
    ("ids", "message"),
    [([1, 1, 2], "unique"), ([1, 2, 10_000], r"lie in \[0, 101\)"), ([-1, 2, 3], "lie in")],
)
def test_bad_draft_vocabulary_is_refused(
    base: PreTrainedModel, tmp_path: Path, ids: list[int], message: str
) -> None:
    heads = _vocab_heads(base, "eagle", [1, 2, 3])
    path = save_heads(heads, tmp_path / "h", fingerprint_of(base))
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    state["draft_vocab"] = torch.tensor(ids)
    save_file(state, str(weights))
    with pytest.raises(HeadsCheckpointError, match=message):
        load_heads(path, base)
    with pytest.raises(ValueError, match=message):
        set_draft_vocab(heads, torch.tensor(ids))


def test_heads_without_a_draft_vocabulary_refuse_one(base: PreTrainedModel) -> None:
    heads = build_heads(heads_config_for(base, "eagle"))
    with pytest.raises(ValueError, match="draft_vocab_size=0"):
        set_draft_vocab(heads, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        heads_config_for(base, "eagle", draft_vocab_size=10_000)
