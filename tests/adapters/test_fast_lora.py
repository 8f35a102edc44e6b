"""The fast LoRA path (`fast_lora.LoraBank` behind `AdapterStore`) is exact: same logits as peft's
own forward per adapter and per row of a mixed batch, lossless speculation, clean switching,
eviction and a visible fallback to peft for what it cannot represent."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import ALL_LINEAR
from lora_helpers import make_adapter, reference_under
from peft import PeftModel
from tiny_models import make_tiny_model

from selfspec import GenerationConfig, SpeculativeGenerator, build_heads, heads_config_for
from selfspec.adapters import fast_lora
from selfspec.adapters.errors import AdapterError, InvalidAdapter
from selfspec.adapters.store import AdapterStore, LoraBackend, StoreConfig

PROMPT = [5, 17, 33, 8, 60, 2, 44]
ROWS = torch.tensor([PROMPT, PROMPT[::-1], [3, 9, 27, 81, 43, 29, 87], PROMPT])  # [4, 7]
TOL = dict(rtol=1e-5, atol=1e-5)
FAST = StoreConfig(backend=LoraBackend.FAST)
# Per architecture: (attention targets, all linear targets) by module name.
TARGETS = {
    "llama": (("q_proj", "v_proj"), ALL_LINEAR),
    "qwen2": (("q_proj", "k_proj"), ALL_LINEAR),
    "gpt2": (("c_attn",), ("c_attn", "c_proj", "c_fc")),  # transformers' Conv1D layers
}


@pytest.fixture(scope="module")
def fallback_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One adapter the bank takes and one it leaves to peft (a config field it does not apply)."""
    root = tmp_path_factory.mktemp("fallback")
    make_adapter(root / "plain", seed=4)
    make_adapter(root / "tied", seed=5, ensure_weight_tying=True)
    return root


def _logits(model: torch.nn.Module, rows: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=rows, **kwargs).logits  # [batch, S, vocab]


def _peft(name: str) -> str:
    return name.replace(".", "_")  # peft adapter names become ModuleDict keys: no '.'


def _peft_model(arch: str, adapters: dict[str, Path]) -> PeftModel:
    """A fresh base with `adapters` loaded by peft's own loader (the reference forward), each
    under `_peft(name)`."""
    model = None
    for our_name, path in adapters.items():
        name = _peft(our_name)
        if model is None:
            model = PeftModel.from_pretrained(make_tiny_model(arch, 0), path, adapter_name=name)
        else:
            model.load_adapter(path, adapter_name=name)
    return model.eval()


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_each_adapter_matches_peft_forward(arch: str, tmp_path: Path) -> None:
    attention, every = TARGETS[arch]
    dirs = {
        "attn": make_adapter(tmp_path / "attn", seed=11, targets=attention, arch=arch),
        "all": make_adapter(tmp_path / "all", seed=12, targets=every, rank=8, arch=arch),
        # Per-module rank and alpha, rsLoRA scaling: the scale must resolve as peft resolves it.
        "patterned": make_adapter(
            tmp_path / "patterned",
            seed=13,
            targets=every,
            rank=6,
            arch=arch,
            use_rslora=True,
            rank_pattern={every[0]: 2},
            alpha_pattern={every[-1]: 5},
        ),
    }
    base = make_tiny_model(arch, 0)
    base_logits = _logits(base, ROWS)
    store = AdapterStore(base, adapters=dirs, config=FAST)
    reference = _peft_model(arch, dirs)
    for name in dirs:
        with store.scope(name)():
            fast = _logits(base, ROWS)
        assert store.backend_of(name) is LoraBackend.FAST
        reference.set_adapter(name)
        expected = _logits(reference, ROWS)
        assert not torch.allclose(expected, base_logits, **TOL), "adapter had no effect"
        torch.testing.assert_close(fast, expected, **TOL)
    assert store.fallbacks == {} and store.fallback_loads == 0


def test_mixed_batch_matches_peft_adapter_names(adapter_root: Path, base) -> None:
    names = ["attn", None, "all.linear", "mlp_down"]
    store = AdapterStore(base, root=adapter_root, config=FAST)
    reference = _peft_model("llama", {n: adapter_root / n for n in store.names()})
    with store.batch_scope(names) as labels:
        mixed = _logits(base, ROWS)
    assert labels == ["attn", "__base__", "all.linear", "mlp_down"]
    expected = _logits(
        reference, ROWS, adapter_names=[_peft(n) if n else "__base__" for n in names]
    )
    torch.testing.assert_close(mixed, expected, **TOL)
    # Each row also equals that adapter alone through the fast path.
    for row, name in enumerate(names):
        with store.scope(name)():
            alone = _logits(base, ROWS[row : row + 1])
        torch.testing.assert_close(mixed[row], alone[0], **TOL)


def test_batch_on_one_adapter_and_wrong_batch_size(adapter_root: Path, base) -> None:
    bare = _logits(base, ROWS)
    store = AdapterStore(base, root=adapter_root, config=FAST)
    with store.scope("attn")():
        alone = _logits(base, ROWS)
    with store.batch_scope(["attn"] * len(ROWS)):
        together = _logits(base, ROWS)
    torch.testing.assert_close(together, alone, rtol=0, atol=0)  # same one-adapter path
    with store.batch_scope(["attn", None]), pytest.raises(ValueError, match="2 rows"):
        _logits(base, ROWS)  # 4 rows under a 2-row selection: a clear error
    assert torch.equal(_logits(base, ROWS), bare)  # a batch scope leaves the base selected


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_speculative_equals_vanilla_and_peft_under_fast_path(
    adapter_root: Path, base, kind: str
) -> None:
    store = AdapterStore(base, root=adapter_root, config=FAST)
    generator = SpeculativeGenerator(base, build_heads(heads_config_for(base, kind)))
    for name in ["all.linear", None, "attn", "mlp_down"]:
        speculative = generator.generate(
            PROMPT, GenerationConfig(max_new_tokens=16, seed=0), scope=store.scope(name)
        ).token_ids
        vanilla = generator.generate(
            PROMPT,
            GenerationConfig(max_new_tokens=16, seed=0, speculate=False),
            scope=store.scope(name),
        ).token_ids
        assert (
            speculative
            == vanilla
            == reference_under(adapter_root / name if name else None, PROMPT, 16)
        ), name
        if name is not None:
            assert store.backend_of(name) is LoraBackend.FAST


def test_switching_back_and_forth_gives_identical_outputs(adapter_root: Path, base) -> None:
    bare = _logits(base, ROWS)
    store = AdapterStore(base, root=adapter_root, config=FAST)
    seen: dict[str | None, list[torch.Tensor]] = {}
    for name in ["attn", "all.linear", "attn", None, "all.linear", None, "attn"]:
        with store.scope(name)():
            seen.setdefault(name, []).append(_logits(base, ROWS))
    for name, outputs in seen.items():
        assert all(torch.equal(outputs[0], other) for other in outputs[1:]), name
    assert not torch.equal(seen["attn"][0], seen["all.linear"][0])
    assert torch.equal(seen[None][0], bare)  # the base adds nothing, not even a rounding


def test_eviction_and_slot_reuse_keep_results_correct(adapter_root: Path, base) -> None:
    bare = _logits(base, ROWS)
    names = ["attn", "all.linear", "mlp_down"]  # ranks 4, 8, 2
    reference = _peft_model("llama", {n: adapter_root / n for n in names})
    expected = {}
    for name in names:
        reference.set_adapter(_peft(name))
        expected[name] = _logits(reference, ROWS)
    store = AdapterStore(base, root=adapter_root, config=StoreConfig(max_resident=2))
    for name in ["attn", "all.linear", "mlp_down", "attn", "mlp_down", "all.linear", "attn"]:
        with store.scope(name)():
            torch.testing.assert_close(_logits(base, ROWS), expected[name], **TOL)
        assert len(store.resident()) <= 2 and store.resident()[-1] == name
    for name in store.resident():
        assert store.unload(name)
    assert not fast_lora.installed_on(base)  # no hook left once nothing is resident
    assert torch.equal(_logits(base, ROWS), bare)


def test_failed_load_leaves_store_and_outputs_unchanged(adapter_root: Path, base, tmp_path) -> None:
    bad = make_adapter(tmp_path / "bad", seed=7)
    config = json.loads((bad / "adapter_config.json").read_text())
    config["r"] = 3  # the weights have rank 4: peft would fail on the shapes, so must we
    (bad / "adapter_config.json").write_text(json.dumps(config))
    store = AdapterStore(base, adapters={"attn": adapter_root / "attn", "bad": bad}, config=FAST)
    with store.scope("attn")():
        before = _logits(base, ROWS)
    with pytest.raises(InvalidAdapter, match="rank 3"):
        store.load("bad")
    assert store.resident() == ("attn",)
    with store.scope("attn")():
        assert torch.equal(_logits(base, ROWS), before)


def test_unsupported_adapter_falls_back_to_peft_visibly(
    fallback_root: Path, base, caplog: pytest.LogCaptureFixture
) -> None:
    bare = _logits(base, ROWS)
    store = AdapterStore(base, root=fallback_root, config=FAST)
    with caplog.at_level(logging.WARNING, logger="selfspec.adapters.store"):
        store.load("tied")
    assert "'tied'" in caplog.text and "ensure_weight_tying" in caplog.text
    assert store.backend_of("tied") is LoraBackend.PEFT
    assert "ensure_weight_tying" in store.fallbacks["tied"]
    assert store.fallback_loads == 1
    store.load("plain")
    assert store.backend_of("plain") is LoraBackend.FAST
    reference = _peft_model("llama", {n: fallback_root / n for n in ("plain", "tied")})
    for name in ["tied", "plain", None, "tied", "plain"]:  # both paths alternate in one base
        with store.scope(name)():
            got = _logits(base, ROWS)
        if name is None:
            assert torch.equal(got, bare)
            continue
        reference.set_adapter(name)
        torch.testing.assert_close(got, _logits(reference, ROWS), **TOL)
    mix = pytest.raises(AdapterError, match="cannot mix fast-path adapters")
    with mix, store.batch_scope(["plain", "tied"]):
        pass
    with store.batch_scope(["tied", None]):  # fallback adapters alone batch through peft
        mixed = _logits(base, ROWS[:2])
    torch.testing.assert_close(mixed[1], bare[1], **TOL)
    reference.set_adapter("tied")
    torch.testing.assert_close(mixed[0], _logits(reference, ROWS[:1])[0], **TOL)


def test_peft_backend_and_config_validation(adapter_root: Path, base) -> None:
    assert StoreConfig(backend="peft").backend is LoraBackend.PEFT
    with pytest.raises(ValueError, match="backend must be one of 'fast', 'peft'"):
        StoreConfig(backend="turbo")
    store = AdapterStore(base, root=adapter_root, config=StoreConfig(backend="peft"))
    store.load("attn")
    assert store.backend_of("attn") is LoraBackend.PEFT
    assert store.backend_of("mlp_down") is None  # known, not resident
    assert store.fallbacks == {} and store.fallback_loads == 0  # chosen, not a fallback


def _random_weights(model: torch.nn.Module, modules: list[str], seed: int, rank: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name in modules:
        linear = model.get_submodule(name)
        lora_a = torch.randn(rank, linear.in_features, generator=generator)  # [r, in]
        lora_b = torch.randn(linear.out_features, rank, generator=generator)  # [out, r]
        out[name] = fast_lora.LoraWeights(lora_a, lora_b, scale=0.5)
    return out


def test_bank_failed_add_leaves_free_slots_zero() -> None:
    model = make_tiny_model("llama", 0)
    bank = fast_lora.LoraBank(model)
    modules = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]
    bank.add("x", _random_weights(model, modules, seed=1, rank=4))
    bank.add("z", _random_weights(model, modules, seed=2, rank=4))
    bank.remove("z")  # a free slot: the next add writes into it in place
    bad = _random_weights(model, modules, seed=3, rank=4)
    last = modules[-1]
    bad[last] = fast_lora.LoraWeights(bad[last].lora_A.to("meta"), bad[last].lora_B, 0.5)
    with pytest.raises((RuntimeError, NotImplementedError)):
        bank.add("y", bad)  # fails on the last module, after writing the first ones
    assert bank.names() == ("x",)
    bank.add("w", _random_weights(model, modules[:1], seed=4, rank=2))  # takes the same slot
    alone = {}
    for name in ("x", "w", None):
        bank.select(name)
        alone[name] = _logits(model, ROWS[:1])[0]
    bank.select_rows(["x", "w", None])
    mixed = _logits(model, ROWS[:1].expand(3, -1))  # one prompt, three rows
    for row, name in enumerate(("x", "w", None)):
        torch.testing.assert_close(mixed[row], alone[name], **TOL)
    bank.close()
    assert not fast_lora.installed_on(model)
