"""EAGLE-3 heads checkpoints: round trip, published tensor names, base fingerprint, vocabulary
maps; the heads registry (no import circle); older Medusa / EAGLE checkpoints still load."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model
from transformers import PreTrainedModel

from selfspec.fingerprint import FingerprintMismatch, fingerprint_of
from selfspec.heads import (
    Eagle3Head,
    EagleHead,
    HeadKind,
    HeadsCheckpointError,
    HeadsConfig,
    MedusaHeads,
    build_heads,
    heads_config_for,
    load_heads,
    save_heads,
)
from selfspec.heads.checkpoint import read_heads_config
from selfspec.heads.draft_vocab import with_draft_vocab
from selfspec.heads.eagle3 import init_from_target, with_eagle3_draft_vocab
from selfspec.heads.registry import heads_class
from selfspec.shipped import SHIPPED_HEADS, shipped_heads_dir

HEADS_DIR = Path(__file__).resolve().parents[1] / "selfspec" / "heads"
PUBLISHED_NAMES = {  # the tensors of a published EAGLE-3 drafter (SpecForge / speculators)
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


@pytest.fixture(scope="module")
def base() -> PreTrainedModel:
    return make_tiny_model("llama", seed=0)


def _heads(model: PreTrainedModel, draft_ids: list[int] | None = None, seed: int = 0) -> Eagle3Head:
    heads = build_heads(heads_config_for(model, "eagle3"))
    init_from_target(heads, model.get_output_embeddings(), model.get_decoder().norm)
    if draft_ids is not None:
        heads = with_eagle3_draft_vocab(heads, torch.tensor(draft_ids), model.lm_head)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in heads.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return heads.eval()


def _outputs(heads: Eagle3Head, model: PreTrainedModel) -> torch.Tensor:
    generator = torch.Generator().manual_seed(42)
    states = torch.randn(1, 5, 3 * heads.config.hidden_size, generator=generator)  # [1, S, 3H]
    tokens = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        hidden = heads(
            model.get_input_embeddings()(tokens), heads.fuse(states), torch.arange(1, 6)[None]
        )
        return heads.logits(hidden)  # [1, S, N]


@pytest.mark.parametrize("draft_ids", [None, [2, 5, 7, 11, 13, 40, 41, 99]], ids=["full", "draft"])
def test_round_trip_gives_identical_outputs(
    base: PreTrainedModel, tmp_path: Path, draft_ids: list[int] | None
) -> None:
    heads = _heads(base, draft_ids)
    path = save_heads(heads, tmp_path / "heads", fingerprint_of(base), extra={"tau": 1.5})
    loaded = load_heads(path, target=base)
    assert isinstance(loaded, Eagle3Head) and loaded.config == heads.config
    assert torch.equal(_outputs(loaded, base), _outputs(heads, base))
    state = load_file(str(path / "model.safetensors"))
    assert set(state) == PUBLISHED_NAMES
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    if draft_ids is not None:
        assert (torch.arange(8) + state["d2t"]).tolist() == draft_ids  # id = index + d2t[index]
        assert state["t2d"].nonzero().flatten().tolist() == draft_ids
    config = json.loads((path / "config.json").read_text())
    assert config["heads"]["kind"] == "eagle3"
    assert config["heads"]["target_layers"] == [0, 1, 1]
    assert config["heads"]["num_key_value_heads"] == 2
    assert config["extra"] == {"tau": 1.5}


def test_loading_onto_another_base_is_refused(base: PreTrainedModel, tmp_path: Path) -> None:
    path = save_heads(_heads(base), tmp_path / "heads", fingerprint_of(base))
    other = make_tiny_model("llama", seed=1)
    with pytest.raises(FingerprintMismatch, match="weights_hash"):
        load_heads(path, target=other)


def test_inconsistent_vocabulary_maps_are_refused(base: PreTrainedModel, tmp_path: Path) -> None:
    path = save_heads(_heads(base, [2, 5, 7, 11]), tmp_path / "heads", fingerprint_of(base))
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    for broken, message in (
        ({"t2d": torch.zeros_like(state["t2d"])}, "t2d does not mark"),
        ({"d2t": torch.tensor([2, 5, 7, 200])}, r"must lie in \[0, 101\)"),
        ({"d2t": torch.tensor([5, 1, 5, 8])}, "ascending"),
        ({"d2t": state["d2t"].int()}, "d2t must be int64"),
    ):
        save_file({**state, **broken}, str(weights))
        with pytest.raises(HeadsCheckpointError, match=message):
            load_heads(path, target=base)


def test_load_in_bfloat16_keeps_the_maps_integer(base: PreTrainedModel, tmp_path: Path) -> None:
    path = save_heads(_heads(base, [2, 5, 7, 11]), tmp_path / "heads", fingerprint_of(base))
    loaded = load_heads(path, target=base, dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.d2t.dtype == torch.int64 and loaded.t2d.dtype == torch.bool


def test_config_validation_names_the_problem() -> None:
    common = dict(kind="eagle3", hidden_size=32, vocab_size=101, num_attention_heads=4)
    with pytest.raises(ValueError, match="target_layers must be one or more"):
        HeadsConfig(**common)
    with pytest.raises(ValueError, match="num_key_value_heads=3 must divide"):
        HeadsConfig(**common, target_layers=(1,), num_key_value_heads=3)
    with pytest.raises(ValueError, match="target_layers / num_key_value_heads are EAGLE-3 fields"):
        HeadsConfig(kind="eagle", hidden_size=32, vocab_size=101, target_layers=(1,))
    with pytest.raises(ValueError, match="swapped afterwards"):
        with_draft_vocab(_heads(make_tiny_model("llama")), torch.arange(4))


def test_the_registry_builds_every_kind_and_names_unknown_ones() -> None:
    assert heads_class(HeadKind.MEDUSA) is MedusaHeads
    assert heads_class("eagle") is EagleHead
    assert heads_class("eagle3") is Eagle3Head
    with pytest.raises(ValueError, match="'eagle4' is not a valid HeadKind"):
        heads_class("eagle4")


def test_heads_modules_import_each_other_without_a_circle() -> None:
    """Every import between selfspec/heads/*.py, also those inside functions, runs one way."""
    graph = {}
    for path in HEADS_DIR.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "selfspec.heads"
            ):
                parts = node.module.split(".")
                names = [parts[2]] if len(parts) > 2 else [a.name for a in node.names]
                imported |= {n for n in names if (HEADS_DIR / f"{n}.py").is_file()}
        graph[path.stem] = imported - {path.stem}
    graph.pop("__init__")

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start]
        )

    circles = [module for module in graph if reaches(module, module, set())]
    assert circles == []


# -- older checkpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(k.value for k in SHIPPED_HEADS))
def test_shipped_checkpoints_still_load(kind: str) -> None:
    path = shipped_heads_dir(kind)
    heads = load_heads(path)  # the real base is not loaded here; its fingerprint is not checked
    assert heads.config.kind.value == kind
    # Their config.json is exactly what this version writes for the same heads: new fields
    # (EAGLE-3's) stay out of other kinds' configs, so older readers still read new checkpoints.
    written = json.loads((path / "config.json").read_text())["heads"]
    assert heads.config.to_dict() == written
    config, _, _ = read_heads_config(path)
    assert config == heads.config and config.target_layers == ()
