"""Per-request adapters stay lossless: speculative == vanilla == peft's own model, per adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_helpers import reference_under

from selfspec import GenerationConfig, SpeculativeGenerator, build_heads, heads_config_for
from selfspec.adapters.errors import AdapterError, StoreFull, UnknownAdapter
from selfspec.adapters.store import AdapterStore, StoreConfig

PROMPT = [5, 17, 33, 8, 60, 2, 44]
NEW = 16
SPECULATIVE = GenerationConfig(max_new_tokens=NEW, seed=0)
VANILLA = GenerationConfig(max_new_tokens=NEW, seed=0, speculate=False)


@pytest.fixture(scope="module")
def references(adapter_root: Path) -> dict[str | None, list[int]]:
    """Greedy output of a fresh model with each adapter loaded by peft itself (None: base)."""
    names = [None, "attn", "all.linear", "mlp_down"]
    return {n: reference_under(adapter_root / n if n else None, PROMPT, NEW) for n in names}


def _generator(base: torch.nn.Module, kind: str = "medusa") -> SpeculativeGenerator:
    return SpeculativeGenerator(base, build_heads(heads_config_for(base, kind)))


def _check(generator, store, name, references) -> None:
    speculative = generator.generate(PROMPT, SPECULATIVE, scope=store.scope(name)).token_ids
    vanilla = generator.generate(PROMPT, VANILLA, scope=store.scope(name)).token_ids
    assert speculative == vanilla == references[name], name


def test_references_differ_so_adapters_are_really_active(references) -> None:
    outputs = [tuple(tokens) for tokens in references.values()]
    assert len(set(outputs)) == len(outputs)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_speculative_equals_vanilla_under_each_adapter_in_a_row(
    base, adapter_root, references, kind
) -> None:
    store = AdapterStore(base, root=adapter_root)
    generator = _generator(base, kind)
    assert store.names() == ("all.linear", "attn", "mlp_down")
    for name in ["attn", "all.linear", None, "mlp_down", "attn", None, "all.linear"]:
        _check(generator, store, name, references)


def test_adapter_unchanged_after_another_was_loaded_used_and_unloaded(
    base, adapter_root, references
) -> None:
    store = AdapterStore(base, root=adapter_root)
    generator = _generator(base)
    _check(generator, store, "attn", references)
    store.load("all.linear")
    _check(generator, store, "all.linear", references)
    assert store.unload("all.linear")
    assert store.resident() == ("attn",)
    _check(generator, store, "attn", references)
    _check(generator, store, None, references)


def test_lru_eviction_under_count_bound_keeps_results_correct(
    base, adapter_root, references
) -> None:
    store = AdapterStore(base, root=adapter_root, config=StoreConfig(max_resident=2))
    generator = _generator(base)
    for name in ["attn", "all.linear", "mlp_down", "attn", "mlp_down", "all.linear"]:
        _check(generator, store, name, references)
        assert len(store.resident()) <= 2
        assert store.resident()[-1] == name
    assert store.resident() == ("mlp_down", "all.linear")


def test_byte_bound_evicts_least_recently_used(base, adapter_root) -> None:
    sizes = {n: AdapterStore(base, root=adapter_root).info(n).nbytes for n in ("attn", "mlp_down")}
    bound = sum(sizes.values())
    store = AdapterStore(base, root=adapter_root, config=StoreConfig(max_bytes=bound))
    store.load("attn")
    store.load("mlp_down")
    store.load("attn")  # touched: now the most recent
    assert store.resident() == ("mlp_down", "attn")
    with pytest.raises(StoreFull, match="more than the store's max_bytes"):
        store.load("all.linear")  # bigger than the whole bound: refused, nothing evicted
    assert store.resident() == ("mlp_down", "attn")
    store.register("attn2", adapter_root / "attn")  # same size as attn
    store.load("attn2")  # evicts mlp_down (least recent), then attn, until it fits
    assert store.resident() == ("attn2",)
    store.load("mlp_down")
    assert store.resident() == ("attn2", "mlp_down")
    assert store.resident_bytes <= bound


def test_pinned_adapters_are_never_evicted(base, adapter_root) -> None:
    store = AdapterStore(base, root=adapter_root, config=StoreConfig(max_resident=1))
    with store.pinned("attn"):
        with pytest.raises(StoreFull, match="pinned"):
            store.load("mlp_down")
        assert store.resident() == ("attn",)
    store.load("mlp_down")
    assert store.resident() == ("mlp_down",)


def test_scope_of_unknown_adapter_fails_before_the_request(base, adapter_root) -> None:
    store = AdapterStore(base, root=adapter_root)
    with pytest.raises(UnknownAdapter, match="known adapters: all.linear, attn, mlp_down"):
        store.scope("nope")
    with pytest.raises(UnknownAdapter):
        store.load("nope")


def test_explicit_pairs_and_resolve_by_directory(base, adapter_root, references) -> None:
    store = AdapterStore(base, adapters={"mine": adapter_root / "attn"})
    assert store.names() == ("mine",)
    assert store.resolve(str(adapter_root / "mlp_down")) == "mlp_down"
    generator = _generator(base)
    tokens = generator.generate(PROMPT, VANILLA, scope=store.scope("mine")).token_ids
    assert tokens == references["attn"]


def test_mixed_adapter_batch_matches_each_adapter_alone(base, adapter_root) -> None:
    store = AdapterStore(base, root=adapter_root)
    body = base.get_decoder()
    rows = torch.tensor([PROMPT, PROMPT[::-1], PROMPT])  # [3, S]
    names = ["attn", None, "all.linear"]
    with torch.inference_mode():
        with store.batch_scope(names):
            mixed = body(input_ids=rows).last_hidden_state  # [3, S, H]
        for row, name in enumerate(names):
            with store.scope(name)():
                alone = body(input_ids=rows[row : row + 1]).last_hidden_state  # [1, S, H]
            torch.testing.assert_close(mixed[row], alone[0], rtol=1e-5, atol=1e-5)


def test_requests_on_different_adapters_interleaved_step_by_step(
    base, adapter_root, references
) -> None:
    store = AdapterStore(base, root=adapter_root, config=StoreConfig(max_resident=2))
    generator = _generator(base, "eagle")
    names = ["attn", "all.linear", None, "mlp_down"]  # 3 adapters, 2 slots: evictions mid-request
    streams = [generator.stream(PROMPT, SPECULATIVE, scope=store.scope(n)) for n in names]
    iterators = [iter(stream) for stream in streams]
    running = set(range(len(names)))
    while running:
        for index in sorted(running):
            if next(iterators[index], None) is None:
                running.discard(index)
    for name, stream in zip(names, streams, strict=True):
        assert stream.result.token_ids == references[name], name


def test_one_store_per_base_model(base, adapter_root) -> None:
    store = AdapterStore(base, root=adapter_root)
    store.load("attn")
    with pytest.raises(TypeError, match="one store per base model"):
        AdapterStore(base)


def test_switching_between_resident_adapters_without_reloading(
    base, adapter_root, references
) -> None:
    store = AdapterStore(base, root=adapter_root)
    for name in store.names():
        store.load(name)
    generator = _generator(base)
    for name in ["attn", "all.linear", "mlp_down", "attn", None, "mlp_down", None, "all.linear"]:
        tokens = generator.generate(PROMPT, VANILLA, scope=store.scope(name)).token_ids
        assert tokens == references[name], name
    assert store.resident() == ("attn", "mlp_down", "all.linear")


def test_a_forgotten_name_can_be_given_other_weights(base, adapter_root, references) -> None:
    store = AdapterStore(base, root=adapter_root)
    generator = _generator(base)
    _check(generator, store, "attn", references)
    with store.pinned("attn"), pytest.raises(AdapterError, match="pinned"):
        store.forget("attn")
    store.forget("attn")
    assert "attn" not in store.names() and "attn" not in store.resident()
    with pytest.raises(UnknownAdapter):
        store.load("attn")
    store.register("attn", adapter_root / "mlp_down")  # an operator replacing it under its name
    tokens = generator.generate(PROMPT, SPECULATIVE, scope=store.scope("attn")).token_ids
    assert tokens == references["mlp_down"]
