"""Interop formats: selfspec EAGLE-3 heads <-> speculators (vLLM's format), FasterDecoding Medusa
-> selfspec. Round trips give identical tensors and drafts; what has no exact counterpart and
malformed input are refused by name; pickles are never read. (The real speculators library is
checked by tests/test_interop_speculators_real.py, marked interop.)"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model, save_tiny_target, tiny_config
from transformers import AutoModelForCausalLM, PreTrainedModel

from selfspec.cli import main
from selfspec.fingerprint import FingerprintMismatch, fingerprint_of
from selfspec.heads import (
    Eagle3Head,
    HeadsConfig,
    MedusaHeads,
    build_heads,
    heads_config_for,
    load_heads,
    save_heads,
)
from selfspec.heads.eagle3 import init_from_target, with_eagle3_draft_vocab
from selfspec.interop import InteropError, export_speculators, import_medusa, import_speculators
from selfspec.interop.speculators import expected_shapes

DRAFT_IDS = [2, 5, 7, 11, 13, 40, 41, 99]
LAYERS = (0, 1, 2)  # distinct, as speculators requires; the tiny base has 2 decoder layers
SPECULATORS_LAYER = {  # the decoder layer's tensors as speculators 0.9.0 names them
    f"layers.0.{name}.weight"
    for name in (
        "input_layernorm",
        "hidden_norm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
}


@pytest.fixture(scope="module")
def base() -> PreTrainedModel:
    return make_tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("base") / "tiny-llama", "llama", seed=0)


def _eagle3(base: PreTrainedModel, draft_ids: list[int] | None = None, seed: int = 0) -> Eagle3Head:
    heads = build_heads(heads_config_for(base, "eagle3", target_layers=LAYERS))
    init_from_target(heads, base.get_output_embeddings(), base.get_decoder().norm)
    if draft_ids is not None:
        heads = with_eagle3_draft_vocab(heads, torch.tensor(draft_ids), base.lm_head)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in heads.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return heads.eval()


def _drafts(heads: Eagle3Head, base: PreTrainedModel) -> torch.Tensor:
    """Draft logits over the whole vocabulary (-inf outside the draft vocabulary) for pairs
    (target state at t, token t+1), as the drafter computes them. # [1, S, vocab]"""
    tokens = torch.tensor([[3, 14, 15, 92, 65, 35, 89]])
    with torch.no_grad():
        states = base(tokens, output_hidden_states=True).hidden_states
        fused = heads.fuse(torch.cat([states[k] for k in heads.config.target_layers], -1))
        embeds = base.get_input_embeddings()(tokens[:, 1:])
        logits = heads.logits(heads(embeds, fused[:, :-1], torch.arange(1, 7)[None]))
    ids = heads.draft_vocab
    if ids is None:
        return logits
    full = torch.full((*logits.shape[:-1], heads.config.vocab_size), float("-inf"))
    full[..., ids] = logits
    return full


def _export(
    base: PreTrainedModel, tmp_path: Path, draft_ids: list[int] | None = None, **options: object
) -> tuple[Eagle3Head, Path]:
    heads = _eagle3(base, draft_ids)
    heads_dir = save_heads(heads, tmp_path / "heads", fingerprint_of(base), extra={"tau": 2.5})
    out = export_speculators(heads_dir, tmp_path / "speculators", base, "org/tiny", **options)
    return heads, out


def _rewrite(out: Path, config: dict | None = None, tensors: dict | None = None) -> None:
    if config is not None:
        (out / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(out / "model.safetensors"))


# -- export ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_ids", [None, DRAFT_IDS], ids=["whole", "draft"])
def test_export_writes_the_speculators_layout(
    base: PreTrainedModel, tmp_path: Path, draft_ids: list[int] | None
) -> None:
    heads, out = _export(base, tmp_path, draft_ids)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == (8 if draft_ids else 101)
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["norm_before_residual"] is False and config["norm_output"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    sizes = ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads")
    assert [layer[k] for k in sizes] == [32, 101, 64, 4]
    assert (layer["num_key_value_heads"], layer["head_dim"]) == (2, 8)
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert layer["max_position_embeddings"] == 512
    spec = config["speculators_config"]
    assert spec["verifier"] == {"name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]}
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["selfspec"]["base"] == fingerprint_of(base).to_dict()
    assert config["selfspec"]["extra"] == {"tau": 2.5}
    tensors = load_file(str(out / "model.safetensors"))
    maps = {"d2t", "t2d"} if draft_ids else set()
    assert set(tensors) == SPECULATORS_LAYER | maps | {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "embed_tokens.weight",
    }
    assert torch.equal(tensors["embed_tokens.weight"], base.get_input_embeddings().weight)
    assert torch.equal(tensors["layers.0.hidden_norm.weight"], heads.midlayer.hidden_norm.weight)
    if draft_ids:
        assert (torch.arange(8) + tensors["d2t"]).tolist() == draft_ids
    assert not list(tmp_path.glob(".speculators.*"))  # no staging directory left behind


def test_export_without_base_or_embedding(base: PreTrainedModel, tmp_path: Path) -> None:
    heads_dir = save_heads(_eagle3(base), tmp_path / "heads", fingerprint_of(base))
    out = export_speculators(heads_dir, tmp_path / "bare")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] is None
    assert "max_position_embeddings" not in config["transformer_layer_config"]
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    with pytest.raises(InteropError, match="embedding needs the base"):
        export_speculators(heads_dir, tmp_path / "again", embedding=True)


def test_export_refuses_what_speculators_cannot_hold(base: PreTrainedModel, tmp_path: Path) -> None:
    fingerprint = fingerprint_of(base)
    medusa = save_heads(build_heads(heads_config_for(base, "medusa")), tmp_path / "m", fingerprint)
    with pytest.raises(InteropError, match="speculators format: it has no Medusa type"):
        export_speculators(medusa, tmp_path / "out")
    eagle = save_heads(build_heads(heads_config_for(base, "eagle")), tmp_path / "e", fingerprint)
    with pytest.raises(InteropError, match="normalises its fused input"):
        export_speculators(eagle, tmp_path / "out")
    doubled = build_heads(heads_config_for(base, "eagle3"))  # default layers (0, 1, 1)
    doubled_dir = save_heads(doubled, tmp_path / "d", fingerprint)
    with pytest.raises(InteropError, match=r"\[0, 1, 1\] cannot be exported.*distinct"):
        export_speculators(doubled_dir, tmp_path / "out")
    valid = save_heads(_eagle3(base), tmp_path / "v", fingerprint)
    with pytest.raises(FingerprintMismatch, match="weights_hash"):
        export_speculators(valid, tmp_path / "out", base=make_tiny_model("llama", seed=1))
    assert not (tmp_path / "out").exists()


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_ids", [None, DRAFT_IDS], ids=["whole", "draft"])
def test_round_trip_gives_identical_tensors_and_drafts(
    base: PreTrainedModel, tmp_path: Path, draft_ids: list[int] | None
) -> None:
    heads, out = _export(base, tmp_path, draft_ids)
    back = import_speculators(out, tmp_path / "back", base, "tiny")
    loaded = load_heads(back, target=base)
    assert loaded.config == heads.config
    original, returned = heads.state_dict(), loaded.state_dict()
    assert set(original) == set(returned)
    assert all(torch.equal(original[k], returned[k]) for k in original)
    assert torch.equal(_drafts(loaded, base), _drafts(heads, base))
    extra = json.loads((back / "config.json").read_text())["extra"]
    assert extra["tau"] == 2.5 and extra["imported_from"]["format"] == "speculators"


def test_cli_round_trip(base: PreTrainedModel, base_dir: Path, tmp_path: Path, capsys) -> None:
    heads = _eagle3(base, DRAFT_IDS)
    heads_dir = save_heads(heads, tmp_path / "heads", fingerprint_of(base))
    out, back = tmp_path / "speculators", tmp_path / "back"
    export = ["export", "--format", "speculators", "--heads", str(heads_dir)]
    assert main([*export, "--base", str(base_dir), "--speculative-tokens", "5", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(base_dir.resolve())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert main([*export, str(out)]) == 1  # OUT exists
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert main([*export, "--overwrite", "--no-embedding", str(out)]) == 0
    imported = ["import", "--format", "speculators", "--base", str(base_dir), str(out), str(back)]
    assert main(imported) == 0
    assert torch.equal(_drafts(load_heads(back, target=base), base), _drafts(heads, base))
    medusa = ["import", "--format", "medusa", "--base", str(base_dir), str(out)]
    assert main([*medusa, str(tmp_path / "medusa-heads")]) == 1
    assert "needs an integer medusa_num_heads" in capsys.readouterr().err


# -- importing foreign checkpoints -----------------------------------------------------------------


def test_specforge_names_unordered_rows_and_no_selfspec_record(
    base: PreTrainedModel, tmp_path: Path
) -> None:
    heads, out = _export(base, tmp_path, DRAFT_IDS, embedding=False)
    config = json.loads((out / "config.json").read_text())
    del config["selfspec"]
    tensors = load_file(str(out / "model.safetensors"))
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}  # SpecForge
    order = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4])  # draft rows in no particular token order
    ids = torch.tensor(DRAFT_IDS)[order]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][order].contiguous()
    tensors["d2t"] = ids - torch.arange(8)
    _rewrite(out, config, tensors)
    loaded = load_heads(import_speculators(out, tmp_path / "back", base), target=base)
    assert loaded.draft_vocab.tolist() == DRAFT_IDS
    torch.testing.assert_close(_drafts(loaded, base), _drafts(heads, base), rtol=0, atol=1e-6)


def test_import_refuses_another_base(base: PreTrainedModel, tmp_path: Path) -> None:
    _, out = _export(base, tmp_path)
    other = make_tiny_model("llama", seed=1)  # same sizes, other weights
    with pytest.raises(FingerprintMismatch, match="weights_hash"):
        import_speculators(out, tmp_path / "x", other)  # the selfspec record names its base
    config = json.loads((out / "config.json").read_text())
    del config["selfspec"]
    _rewrite(out, config)
    with pytest.raises(InteropError, match="differs from the base's token embedding"):
        import_speculators(out, tmp_path / "x", other)
    wide = tiny_config("llama")
    wide.hidden_size = 48
    wide_model = AutoModelForCausalLM.from_config(wide)
    with pytest.raises(InteropError, match="hidden size 32; the given base .* has 48"):
        import_speculators(out, tmp_path / "x", wide_model)
    shallow = tiny_config("llama")
    shallow.num_hidden_layers = 1
    with pytest.raises(InteropError, match=r"\[0, 1, 2\] must be distinct .* in \[0, 1\]"):
        import_speculators(out, tmp_path / "x", AutoModelForCausalLM.from_config(shallow))
    config["speculators_config"]["verifier"]["architectures"] = ["Qwen2ForCausalLM"]
    _rewrite(out, config)
    with pytest.raises(InteropError, match="architecture Qwen2ForCausalLM; the given base is L"):
        import_speculators(out, tmp_path / "x", base)
    assert not (tmp_path / "x").exists()


CONFIG_BREAKS = [
    (lambda c: c.pop("speculators_model_type"), "no speculators_model_type"),
    (lambda c: c.update(speculators_model_type="eagle"), "'eagle'; selfspec imports 'eagle3'"),
    (lambda c: c.update(speculators_model_type="dflash"), "imports 'eagle3' drafters only"),
    (lambda c: c.pop("transformer_layer_config"), "transformer_layer_config must be a JSON"),
    (lambda c: c["transformer_layer_config"].pop("model_type"), "reads a missing model_type"),
    (lambda c: c["transformer_layer_config"].pop("hidden_size"), r"lacks \['hidden_size'\]"),
    (lambda c: c["transformer_layer_config"].update(hidden_size="wide"), "is invalid"),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), "num_hidden_layers=2"),
    (lambda c: c["transformer_layer_config"].update(mlp_bias=True), "mlp_bias=true"),
    (
        lambda c: c["transformer_layer_config"]["rope_parameters"].update(
            rope_type="linear", factor=2.0
        ),
        "rope_type='linear'",
    ),
    (lambda c: c.pop("draft_vocab_size"), "needs an integer draft_vocab_size"),
    (lambda c: c.update(draft_vocab_size=500), r"must be in \[1, 101\]"),
    (lambda c: c.pop("norm_before_residual"), "vLLM as true"),
    (lambda c: c.update(norm_before_residual=True), "norm_before_residual=True"),
    (lambda c: c.update(fc_norm=True), "fc_norm=True"),
    (lambda c: c.update(target_hidden_size=64), "target_hidden_size=64"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=None), r"\[2, 1, -1\] must be distinct"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 0, 1]), "must be distinct"),
]


@pytest.mark.parametrize("change, message", CONFIG_BREAKS)
def test_malformed_config_is_refused_by_name(
    base: PreTrainedModel, tmp_path: Path, change, message: str
) -> None:
    _, out = _export(base, tmp_path, DRAFT_IDS)
    config = json.loads((out / "config.json").read_text())
    del config["selfspec"]
    change(config)
    _rewrite(out, config)
    with pytest.raises(InteropError, match=message):
        import_speculators(out, tmp_path / "back", base)


def _swap(name: str, value: torch.Tensor):
    return lambda tensors: tensors.__setitem__(name, value)


WEIGHT_BREAKS = [
    (lambda t: t.pop("norm.weight"), r"missing \['norm.weight'\]"),
    (_swap("layers.0.mlp.up_proj.weight", torch.zeros(64, 31)), r"up_proj.weight \(64, 31\)"),
    (_swap("layers.1.mlp.up_proj.weight", torch.zeros(64, 32)), r"unexpected \['layers.1"),
    (_swap("layers.0.self_attn.q_norm.weight", torch.zeros(8)), "unexpected.*q_norm"),
    (_swap("t2d", torch.zeros(101, dtype=torch.bool)), "t2d does not mark exactly"),
    (_swap("d2t", torch.tensor([2, 4, 5, 8, 9, 35, 34, 92])), "d2t: .*unique"),
    (_swap("d2t", torch.zeros(8)), "d2t and t2d must be integer"),
    (_swap("fc.weight", torch.zeros(32, 96, dtype=torch.int32)), "fc.weight must be floating"),
    (_swap("embed_tokens.weight", torch.zeros(101, 32)), "differs from the base's token"),
    (
        lambda t: t.__setitem__("midlayer.hidden_norm.weight", torch.ones(32)),
        "layers.0.hidden_norm.weight is there twice",
    ),
]


@pytest.mark.parametrize("change, message", WEIGHT_BREAKS)
def test_malformed_weights_are_refused_by_name(
    base: PreTrainedModel, tmp_path: Path, change, message: str
) -> None:
    _, out = _export(base, tmp_path, DRAFT_IDS)
    tensors = load_file(str(out / "model.safetensors"))
    change(tensors)
    _rewrite(out, tensors=tensors)
    with pytest.raises(InteropError, match=message):
        import_speculators(out, tmp_path / "back", base)
    assert not (tmp_path / "back").exists()


def test_broken_files_are_refused(base: PreTrainedModel, tmp_path: Path, monkeypatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(torch, "load", never)
    monkeypatch.setattr(pickle, "load", never)
    _, out = _export(base, tmp_path)
    weights = out / "model.safetensors"
    weights.rename(out / "pytorch_model.bin")
    with pytest.raises(InteropError, match=r"only pickled weights \(pytorch_model.bin\)"):
        import_speculators(out, tmp_path / "back", base)
    (out / "pytorch_model.bin").unlink()
    with pytest.raises(InteropError, match="has no model.safetensors"):
        import_speculators(out, tmp_path / "back", base)
    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(InteropError, match="not a readable safetensors file"):
        import_speculators(out, tmp_path / "back", base)
    (out / "config.json").write_text("{not json")
    with pytest.raises(InteropError, match="not valid JSON"):
        import_speculators(out, tmp_path / "back", base)
    (out / "config.json").write_text("[1, 2]")
    with pytest.raises(InteropError, match="must hold a JSON object"):
        import_speculators(out, tmp_path / "back", base)
    with pytest.raises(InteropError, match="is not a directory"):
        import_speculators(tmp_path / "nowhere", tmp_path / "back", base)
    with pytest.raises(InteropError, match="is the input"):
        import_speculators(out, out, base, overwrite=True)


def test_sharded_weights_import(base: PreTrainedModel, tmp_path: Path) -> None:
    heads, out = _export(base, tmp_path, DRAFT_IDS)
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-1.safetensors": names[:5], "model-2.safetensors": names[5:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    index = out / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_heads(import_speculators(out, tmp_path / "back", base), target=base)
    assert torch.equal(_drafts(loaded, base), _drafts(heads, base))
    index.write_text(json.dumps({"weight_map": {**weight_map, "fc.weight": "../elsewhere.bin"}}))
    with pytest.raises(InteropError, match="not a .safetensors file name"):
        import_speculators(out, tmp_path / "again", base)


def test_expected_shapes_are_the_heads_own() -> None:
    for draft in (0, 8):
        config = HeadsConfig(
            kind="eagle3",
            hidden_size=32,
            vocab_size=101,
            num_attention_heads=4,
            num_key_value_heads=2,
            target_layers=LAYERS,
            draft_vocab_size=draft,
        )
        own = {
            k.replace("midlayer.", "layers.0."): tuple(v.shape)
            for k, v in build_heads(config).state_dict().items()
            if draft or k not in ("d2t", "t2d")
        }
        assert expected_shapes(config) == own


# -- FasterDecoding Medusa -------------------------------------------------------------------------


def _faster_medusa(path: Path, base: PreTrainedModel, heads: int = 3, layers: int = 2) -> Path:
    """A FasterDecoding Medusa directory: random blocks, each head's lm_head the base's."""
    path.mkdir(parents=True)
    generator = torch.Generator().manual_seed(5)
    tensors = {}
    for head in range(heads):
        for block in range(layers):
            tensors[f"{head}.{block}.linear.weight"] = torch.randn(32, 32, generator=generator)
            tensors[f"{head}.{block}.linear.bias"] = torch.randn(32, generator=generator)
        tensors[f"{head}.{layers}.weight"] = base.lm_head.weight.detach().clone()
    save_file(tensors, str(path / "medusa_lm_head.safetensors"))
    config = {
        "medusa_num_heads": heads,
        "medusa_num_layers": layers,
        "base_model_name_or_path": "tiny",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_medusa_import_computes_what_fasterdecoding_does(
    base: PreTrainedModel, tmp_path: Path
) -> None:
    source = _faster_medusa(tmp_path / "medusa", base)
    loaded = load_heads(import_medusa(source, tmp_path / "heads", base), target=base)
    assert isinstance(loaded, MedusaHeads)
    assert (loaded.config.num_heads, loaded.config.num_layers) == (3, 2)
    tensors = load_file(str(source / "medusa_lm_head.safetensors"))
    features = torch.randn(5, 32, generator=torch.Generator().manual_seed(6))  # [S, H]
    with torch.no_grad():
        ours = base.lm_head(loaded(features))  # [S, K, vocab]
        for head in range(3):  # FasterDecoding: Sequential(ResBlock x L, Linear) per head
            x = features
            for block in range(2):
                linear = f"{head}.{block}.linear."
                x = x + torch.nn.functional.silu(
                    x @ tensors[linear + "weight"].T + tensors[linear + "bias"]
                )
            expected = x @ tensors[f"{head}.2.weight"].T
            torch.testing.assert_close(ours[:, head], expected, rtol=0, atol=1e-5)


def test_medusa_import_refuses_what_does_not_map(
    base: PreTrainedModel, tmp_path: Path, monkeypatch
) -> None:
    source = _faster_medusa(tmp_path / "medusa", base)
    weights = source / "medusa_lm_head.safetensors"
    tensors = load_file(str(weights))
    own = dict(tensors)
    own["1.2.weight"] = own["1.2.weight"] + 0.01  # head 1 trained its own lm_head
    save_file(own, str(weights))
    with pytest.raises(InteropError, match="Medusa head 1 has its own lm_head"):
        import_medusa(source, tmp_path / "out", base)
    save_file({k: v for k, v in tensors.items() if k != "0.1.linear.bias"}, str(weights))
    with pytest.raises(InteropError, match=r"missing \['0.1.linear.bias'\]"):
        import_medusa(source, tmp_path / "out", base)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was opened"))
    weights.rename(source / "medusa_lm_head.pt")
    with pytest.raises(InteropError, match=r"only pickled weights \(medusa_lm_head.pt\)"):
        import_medusa(source, tmp_path / "out", base)
    (source / "config.json").write_text(json.dumps({"medusa_num_heads": 3}))
    with pytest.raises(InteropError, match="needs an integer medusa_num_layers"):
        import_medusa(source, tmp_path / "out", base)
    assert not (tmp_path / "out").exists()
