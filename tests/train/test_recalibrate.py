"""`selfspec recalibrate`: heads fine-tuned for one adapter, saved beside it, measured.

One recalibration run of a tiny Llama (shared by the tests of this module) on an adapter that
moves the target strongly: the heads land in `<adapter>/heads/`, load on the base, learn the
adapted target (training loss down, held-out top-1 agreement up), and stay lossless under it.
A second run trains a low-rank delta instead (`<adapter>/heads-delta/`), which learns too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from tiny_models import VOCAB_SIZE
from train_helpers import write_prompts

from selfspec.adapters import AdapterStore
from selfspec.cli import main
from selfspec.fingerprint import fingerprint_of
from selfspec.generation import GenerationConfig, SpeculativeGenerator
from selfspec.heads import HeadKind, build_heads, heads_config_for, load_heads, save_heads
from selfspec.heads.draft_vocab import set_draft_vocab
from selfspec.target import TargetSpec, apply_chat_template, load_target

VOCAB = VOCAB_SIZE
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRAIN = [f"say {w} {n}" for w in ("hi", "no", "yes", "ok", "go", "up", "on", "at") for n in "12"]
HELDOUT = ["say so 7", "say we 9", "say it 4", "say me 5"]


def make_adapter(base_dir: Path, path: Path, seed: int = 3) -> Path:
    """A LoRA adapter of the tiny target on every linear layer, with random non-zero weights."""
    model = load_target(TargetSpec(model=str(base_dir))).model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR))
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=0.5)
    peft_model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def setup(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recalibrate")
    model = load_target(TargetSpec(model=str(tiny_target))).model
    # The "base heads", drafting from the even token ids (a draft vocabulary the adapter's
    # deltas extend).
    heads = build_heads(heads_config_for(model, HeadKind.EAGLE, draft_vocab_size=(VOCAB + 1) // 2))
    set_draft_vocab(heads, torch.arange(0, VOCAB, 2))
    paths = {
        "root": root / "adapters",
        "adapter": make_adapter(tiny_target, root / "adapters" / "loud"),
        "heads": save_heads(heads, root / "base-heads", fingerprint_of(model)),
        "prompts": write_prompts(root / "train.jsonl", TRAIN),
        "heldout": write_prompts(root / "heldout.jsonl", HELDOUT),
        "out": root / "report",
    }
    return paths


def argv(tiny_target: Path, setup: dict[str, Path], *extra: str, adapter: str = "loud") -> list:
    return [
        "recalibrate",
        "--adapter", adapter,
        "--adapters-root", str(setup["root"]),
        "--model", str(tiny_target),
        "--heads", str(setup["heads"]),
        "--prompts", str(setup["prompts"]),
        "--heldout-prompts", str(setup["heldout"]),
        "--max-prompts", "16",
        "--max-new-tokens", "24",
        "--eval-prompts", "4",
        "--eval-max-new-tokens", "20",
        "--max-steps", "40",
        "--batch-size", "8",
        "--lr", "3e-3",
        "--eagle-depth", "1",
        "--loss-vocab-size", "0",
        "--out", str(setup["out"]),
        "--delta-rank", "0",  # a full copy of the heads (the delta tests override it)
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def report(tiny_target: Path, setup: dict[str, Path]) -> dict:
    assert main(argv(tiny_target, setup)) == 0
    return json.loads((setup["out"] / "recalibration.json").read_text())


def test_heads_are_saved_beside_the_adapter_and_load_on_the_base(
    report: dict, setup: dict[str, Path], tiny_target: Path
) -> None:
    heads_dir = setup["adapter"] / "heads"
    assert report["heads_path"] == str(heads_dir.resolve())
    base = load_target(TargetSpec(model=str(tiny_target))).model
    heads = load_heads(heads_dir, base)
    assert heads.config.kind is HeadKind.EAGLE
    config = json.loads((heads_dir / "config.json").read_text())
    assert config["base"] == fingerprint_of(base).to_dict()
    assert config["extra"]["recalibrated_for"] == "loud"
    store = AdapterStore(base, root=setup["root"])
    assert store.info("loud").heads_path == heads_dir.resolve()
    assert (setup["out"] / "recalibration.md").read_text().count("| loud |") == 2


def test_heads_learn_the_adapted_target(report: dict) -> None:
    agreement = report["agreement"]
    assert agreement["train_after"]["loss"] < 0.8 * agreement["train_before"]["loss"]
    losses = report["losses"]
    assert len(losses) == 40
    assert sum(losses[-5:]) < sum(losses[:5])
    # Held-out rows: the draft's first token agrees with the adapted target more often.
    assert agreement["heldout_after"]["top1"] > agreement["heldout_before"]["top1"] + 0.1
    rows = report["rows"]
    assert [(r["name"], r["heads"]) for r in rows] == [
        ("(base)", "base"), ("loud", "base"), ("loud", "own"),
    ]  # fmt: skip
    assert report["tau_before"] == rows[1]["tau"] and report["tau_after"] == rows[2]["tau"]


def test_new_heads_are_lossless_under_the_adapter(
    report: dict, setup: dict[str, Path], tiny_target: Path
) -> None:
    assert all(row["lossless"] for row in report["rows"])
    # Independently of the report: against peft's own loader and a plain greedy loop.
    target = load_target(TargetSpec(model=str(tiny_target)))
    store = AdapterStore(target.model, root=setup["root"])
    generator = SpeculativeGenerator(
        target.model, load_heads(setup["adapter"] / "heads", target.model), target.tokenizer
    )
    reference = PeftModel.from_pretrained(
        load_target(TargetSpec(model=str(tiny_target))).model, setup["adapter"]
    ).eval()
    for prompt in HELDOUT:
        ids = apply_chat_template(target.tokenizer, prompt)
        got = generator.generate(
            ids, GenerationConfig(max_new_tokens=16), scope=store.scope("loud")
        )
        assert got.token_ids == _greedy(reference, ids, len(got.token_ids))


def test_existing_heads_are_not_overwritten(
    report: dict, setup: dict[str, Path], tiny_target: Path, capsys: pytest.CaptureFixture
) -> None:
    weights = setup["adapter"] / "heads" / "model.safetensors"
    saved = weights.read_bytes()
    assert main(argv(tiny_target, setup)) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert weights.read_bytes() == saved


def test_overwrite_replaces_the_heads(
    report: dict, setup: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    weights = setup["adapter"] / "heads" / "model.safetensors"
    saved = weights.read_bytes()
    short = argv(tiny_target, setup, "--overwrite", "--max-steps", "3", "--out", str(tmp_path))
    short[short.index("--max-prompts") + 1] = "8"
    assert main(short) == 0
    assert weights.read_bytes() != saved
    assert json.loads((tmp_path / "recalibration.json").read_text())["losses"].__len__() == 3


def test_unknown_adapter_is_a_clear_error(
    setup: dict[str, Path], tiny_target: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(argv(tiny_target, setup, adapter="nope")) == 2
    err = capsys.readouterr().err
    assert "unknown adapter 'nope'" in err and "loud" in err


def test_heads_of_another_base_are_refused(
    setup: dict[str, Path],
    tiny_target: Path,
    other_target: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    other = load_target(TargetSpec(model=str(other_target))).model
    foreign = save_heads(
        build_heads(heads_config_for(other, HeadKind.EAGLE)), tmp_path / "h", fingerprint_of(other)
    )
    args = argv(tiny_target, setup, "--overwrite")
    args[args.index("--heads") + 1] = str(foreign)
    assert main(args) == 2
    assert "heads at" in capsys.readouterr().err


@torch.no_grad()
def _greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_a_delta_learns_the_adapted_target_at_a_fraction_of_the_size(
    report: dict, setup: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    run = argv(tiny_target, setup, "--delta-rank", "4", "--lr", "1e-2", "--out", str(tmp_path))
    assert main(run) == 0
    delta_dir = setup["adapter"] / "heads-delta"
    record = json.loads((delta_dir / "delta.json").read_text())
    assert record["rank"] == 4 and record["recalibrated_for"] == "loud"
    # Its draft vocabulary: the shared heads' plus the adapted target's own tokens.
    vocab = load_file(str(delta_dir / "delta.safetensors"))["draft_vocab"]
    assert VOCAB // 2 < record["draft_vocab_size"] == len(vocab) <= VOCAB
    assert set(range(0, VOCAB, 2)) <= set(vocab.tolist())
    full = (setup["adapter"] / "heads" / "model.safetensors").stat().st_size
    assert (delta_dir / "delta.safetensors").stat().st_size < 0.5 * full
    delta_report = json.loads((tmp_path / "recalibration.json").read_text())
    agreement = delta_report["agreement"]
    assert agreement["heldout_after"]["top1"] > agreement["heldout_before"]["top1"] + 0.1
    assert all(row["lossless"] for row in delta_report["rows"])
    assert delta_report["heads_path"] == str(delta_dir.resolve())


def test_learning_rate_and_steps_default_to_what_is_trained() -> None:
    """A delta (its low-rank pairs start at zero) trains at 3e-3 for 150 steps unless told, a
    full copy at 3e-4 for 60; given values are used as they are; bad ones are refused."""
    from selfspec.train.recalibrate import RecalibrateConfig

    delta, full = RecalibrateConfig(adapter="a"), RecalibrateConfig(adapter="a", delta_rank=0)
    assert (delta.learning_rate, delta.steps) == (3e-3, 150)
    assert (full.learning_rate, full.steps) == (3e-4, 60)
    given = RecalibrateConfig(adapter="a", lr=1e-3, max_steps=7)
    assert (given.learning_rate, given.steps) == (1e-3, 7)
    with pytest.raises(ValueError, match="--lr"):
        RecalibrateConfig(adapter="a", lr=0.0)
    with pytest.raises(ValueError, match="--max-steps"):
        RecalibrateConfig(adapter="a", max_steps=0)


def test_eagle3_heads_recalibrate_with_a_delta_from_the_adapted_targets_layers(
    setup: dict[str, Path], tiny_target: Path, tmp_path: Path
) -> None:
    """EAGLE-3 heads read the target's states at their layers: recalibration taps the adapted
    target's while it answers (``layer_features``), and their delta learns it, losslessly."""
    from selfspec.heads.eagle3 import with_eagle3_draft_vocab

    target = load_target(TargetSpec(model=str(tiny_target)))
    model = target.model
    # Drafting from the even token ids: its own lm_head rows are those tokens'.
    drafting = with_eagle3_draft_vocab(
        build_heads(heads_config_for(model, HeadKind.EAGLE3)),
        torch.arange(0, VOCAB, 2),
        model.get_output_embeddings(),
    )
    heads = save_heads(drafting, tmp_path / "eagle3-heads", fingerprint_of(model))
    run = argv(tiny_target, setup, "--delta-rank", "4", "--lr", "1e-2", "--out", str(tmp_path))
    run[run.index("--heads") + 1] = str(heads)
    run[run.index("--max-steps") + 1] = "30"
    adapter = make_adapter(tiny_target, setup["root"] / "loud3", seed=4)
    run[run.index("--adapter") + 1] = "loud3"
    assert main(run) == 0
    delta_dir = adapter / "heads-delta"
    assert json.loads((delta_dir / "delta.json").read_text())["recalibrated_for"] == "loud3"
    report = json.loads((tmp_path / "recalibration.json").read_text())
    agreement = report["agreement"]
    assert agreement["heldout_after"]["top1"] > agreement["heldout_before"]["top1"] + 0.1
    assert all(row["lossless"] for row in report["rows"])
