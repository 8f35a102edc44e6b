"""Bad input: each case is a clear, typed error, and the store is left exactly as it was."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lora_helpers import make_adapter
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from selfspec import GenerationConfig, SpeculativeGenerator
from selfspec.adapters.errors import (
    AdapterError,
    AdapterPathError,
    CorruptAdapter,
    IncompatibleAdapter,
    InvalidAdapter,
    PickleAdapter,
    RankTooHigh,
    UnknownAdapter,
    UnsafeAdapterName,
)
from selfspec.adapters.store import AdapterStore, StoreConfig
from selfspec.adapters.validate import META_FILE, WEIGHTS_FILE, AdapterLimits
from selfspec.fingerprint import fingerprint_of

PROMPT = [5, 17, 33, 8, 60]
VANILLA = GenerationConfig(max_new_tokens=8, speculate=False)


def _rewrite_weights(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    state = load_file(str(directory / WEIGHTS_FILE))
    edit(state)
    save_file(state, str(directory / WEIGHTS_FILE))
    return directory


def _case_dir(tmp: Path, good: Path, case: str) -> Path:
    """Build the bad adapter directory `tmp/<case>` (from a copy of a good one where useful)."""
    target = tmp / case
    if case == "no_config":
        target.mkdir()
        shutil.copy(good / WEIGHTS_FILE, target)
    elif case == "no_weights":
        target.mkdir()
        shutil.copy(good / "adapter_config.json", target)
    elif case == "pickle":
        target.mkdir()
        shutil.copy(good / "adapter_config.json", target)
        (target / "adapter_model.bin").write_bytes(b"\x80\x04 never unpickled")
    elif case == "other_architecture":
        make_adapter(target, seed=4, targets=("c_attn",), arch="gpt2")
    elif case == "other_base_weights":
        make_adapter(target, seed=4, base_seed=7)
        other = fingerprint_of(make_tiny_model("llama", 7))
        (target / META_FILE).write_text(json.dumps({"base": other.to_dict()}))
    elif case == "wrong_shapes":
        shutil.copytree(good, target)

        def widen(state: dict[str, torch.Tensor]) -> None:
            key = next(k for k in state if k.endswith("q_proj.lora_A.weight"))
            state[key] = torch.zeros(state[key].shape[0], 48)

        _rewrite_weights(target, widen)
    elif case == "missing_module":
        shutil.copytree(good, target)

        def drop(state: dict[str, torch.Tensor]) -> None:
            for key in [k for k in state if "layers.1.self_attn.q_proj" in k]:
                del state[key]

        _rewrite_weights(target, drop)
    elif case == "high_rank":
        make_adapter(target, seed=4, rank=16)
    elif case == "truncated":
        shutil.copytree(good, target)
        data = (target / WEIGHTS_FILE).read_bytes()
        (target / WEIGHTS_FILE).write_bytes(data[: len(data) - 64])
    elif case == "lm_head":
        make_adapter(target, seed=4, targets=("q_proj", "lm_head"))
    elif case == "embedding":
        make_adapter(target, seed=4, targets=("embed_tokens",))
    elif case == "dora":
        make_adapter(target, seed=4, use_dora=True)
    elif case == "not_lora":
        shutil.copytree(good, target)
        config = json.loads((target / "adapter_config.json").read_text())
        (target / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    elif case == "pissa":
        shutil.copytree(good, target)
        config = json.loads((target / "adapter_config.json").read_text())
        config["init_lora_weights"] = "pissa"
        (target / "adapter_config.json").write_text(json.dumps(config))
    elif case == "bad_json":
        shutil.copytree(good, target)
        (target / "adapter_config.json").write_text("{not json")
    else:
        raise AssertionError(case)
    return target


REGISTER_CASES = {
    "no_config": (InvalidAdapter, "has no adapter_config.json"),
    "no_weights": (InvalidAdapter, "has no adapter_model.safetensors"),
    "pickle": (PickleAdapter, "pickle .*save_file"),
    "other_architecture": (IncompatibleAdapter, "exist in the loaded base"),
    "other_base_weights": (IncompatibleAdapter, "was made for base"),
    "wrong_shapes": (IncompatibleAdapter, r"the base needs \[r, 32\]"),
    "missing_module": (IncompatibleAdapter, "without weights"),
    "high_rank": (RankTooHigh, "rank 16, above the limit of 8"),
    "truncated": (CorruptAdapter, "truncated or corrupt"),
    "lm_head": (InvalidAdapter, "token embedding or lm_head"),
    "embedding": (InvalidAdapter, "token embedding or lm_head"),
    "dora": (InvalidAdapter, "DoRA"),
    "not_lora": (InvalidAdapter, "only peft LoRA"),
    "bad_json": (InvalidAdapter, "not valid JSON"),
    "pissa": (InvalidAdapter, "rewrites the base"),
}


@pytest.fixture(scope="module")
def bad_root(tmp_path_factory, adapter_root: Path) -> Path:
    """A root with one good adapter and every bad case beside it."""
    root = tmp_path_factory.mktemp("bad_root")
    shutil.copytree(adapter_root / "attn", root / "good")
    for case in REGISTER_CASES:
        _case_dir(root, adapter_root / "attn", case)
    return root


@pytest.fixture
def store(base, bad_root: Path) -> AdapterStore:
    store = AdapterStore(base, root=bad_root, config=StoreConfig(limits=AdapterLimits(max_rank=8)))
    store.load("good")
    return store


def _snapshot(store: AdapterStore) -> tuple:
    generator = SpeculativeGenerator(store.base_model)
    tokens = generator.generate(PROMPT, VANILLA, scope=store.scope("good")).token_ids
    return store.names(), store.resident(), store.resident_bytes, tokens


def test_scanning_a_root_keeps_only_valid_adapters_with_reasons(store: AdapterStore) -> None:
    assert store.names() == ("good",)
    assert set(store.rejected) == set(REGISTER_CASES)
    for case, (_, pattern) in REGISTER_CASES.items():
        assert re.search(pattern, store.rejected[case]), case


@pytest.mark.parametrize("case", sorted(REGISTER_CASES))
def test_each_bad_adapter_is_a_typed_error_and_the_store_is_unchanged(
    store: AdapterStore, bad_root: Path, case: str
) -> None:
    error_type, pattern = REGISTER_CASES[case]
    before = _snapshot(store)
    with pytest.raises(error_type, match=pattern):
        store.register(case, bad_root / case)
    with pytest.raises(UnknownAdapter):
        store.load(case)
    assert _snapshot(store) == before


@pytest.mark.parametrize("name", ["../good", "a/b", "", ".hidden", "x" * 65, "sp ace", "a\\b"])
def test_names_with_path_characters_are_refused(store, bad_root, name) -> None:
    before = _snapshot(store)
    with pytest.raises(UnsafeAdapterName, match="not allowed"):
        store.register(name, bad_root / "good")
    assert _snapshot(store) == before


def test_paths_outside_the_root_are_refused(store, bad_root, adapter_root, tmp_path) -> None:
    before = _snapshot(store)
    with pytest.raises(AdapterPathError, match="outside the adapters root"):
        store.register("outside", adapter_root / "attn")
    with pytest.raises(AdapterPathError, match="contains '..'"):
        store.register("dotdot", bad_root / ".." / "x")
    link = bad_root / "escape"
    link.symlink_to(adapter_root / "attn", target_is_directory=True)
    try:
        with pytest.raises(AdapterPathError, match="symlinks are followed"):
            store.register("escape", link)
    finally:
        link.unlink()
    linked_file = bad_root / "linked_weights"
    linked_file.mkdir()
    shutil.copy(adapter_root / "attn" / "adapter_config.json", linked_file)
    (linked_file / WEIGHTS_FILE).symlink_to(adapter_root / "attn" / WEIGHTS_FILE)
    try:
        with pytest.raises(AdapterPathError, match="is a link to"):
            store.register("linked_weights", linked_file)
    finally:
        shutil.rmtree(linked_file)
    assert _snapshot(store) == before


def test_non_finite_weights_fail_at_load_and_leave_the_store_unchanged(
    base, adapter_root, tmp_path
) -> None:
    nan = shutil.copytree(adapter_root / "attn", tmp_path / "nan")
    _rewrite_weights(nan, lambda state: next(iter(state.values())).fill_(float("nan")))
    store = AdapterStore(base, adapters={"good": adapter_root / "attn", "nan": nan})
    store.load("good")
    before = _snapshot(store)
    with pytest.raises(CorruptAdapter, match="NaN or inf"):
        store.load("nan")
    assert _snapshot(store) == before


def test_a_file_changed_after_registration_is_validated_again_at_load(
    base, adapter_root, tmp_path
) -> None:
    changing = shutil.copytree(adapter_root / "attn", tmp_path / "changing")
    store = AdapterStore(base, adapters={"changing": changing})
    data = (changing / WEIGHTS_FILE).read_bytes()
    (changing / WEIGHTS_FILE).write_bytes(data[:100])
    with pytest.raises(CorruptAdapter):
        store.load("changing")
    assert store.resident() == ()


def test_every_error_is_an_adapter_error_and_a_value_error() -> None:
    for error_type in (UnknownAdapter, PickleAdapter, AdapterPathError, RankTooHigh):
        assert issubclass(error_type, AdapterError)
        assert issubclass(error_type, ValueError)
