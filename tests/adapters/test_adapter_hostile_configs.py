"""Hostile or malformed adapter configs: each is a quick, clear `AdapterError` naming the file and
the field, never a stray exception or a stalled store; validation runs outside the store's lock."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import selfspec.adapters.store as store_module
from selfspec.adapters.errors import InvalidAdapter, RankTooHigh
from selfspec.adapters.store import AdapterStore
from selfspec.adapters.validate import CONFIG_FILE

ADVERSARIAL = "(.*)(.*)(.*)(.*)(.*)(.*)X"


def _with_config(
    good: Path, target: Path, edit: Callable[[dict], object] | None = None, text: str | None = None
) -> Path:
    """A copy of adapter `good` at `target`, its config edited in place or replaced by `text`."""
    shutil.copytree(good, target)
    if text is None:
        config = json.loads((target / CONFIG_FILE).read_text())
        edit(config)
        text = json.dumps(config)
    (target / CONFIG_FILE).write_text(text)
    return target


def test_a_backtracking_target_regex_is_refused_quickly(base, adapter_root, tmp_path) -> None:
    bad = _with_config(
        adapter_root / "attn", tmp_path / "bad", lambda c: c.update(target_modules=ADVERSARIAL)
    )
    store = AdapterStore(base, root=tmp_path)
    assert store.rejected["bad"]  # the scan at construction recorded it
    start = time.perf_counter()
    with pytest.raises(InvalidAdapter) as caught:
        store.register("bad", bad)
    assert time.perf_counter() - start < 1.0
    message = str(caught.value)
    assert "'bad'" in message and CONFIG_FILE in message and "target_modules" in message
    assert "backtracking" in message
    assert str(tmp_path) not in message  # paths are shown relative to the root


@pytest.mark.parametrize(
    "pattern", [r".*\.(q_proj|v_proj)", r"model\.layers\.\d+\.self_attn\.(q|v)_proj"]
)
def test_a_plain_target_regex_still_works(base, adapter_root, tmp_path, pattern) -> None:
    _with_config(
        adapter_root / "attn", tmp_path / "regex", lambda c: c.update(target_modules=pattern)
    )
    store = AdapterStore(base, root=tmp_path)
    assert store.names() == ("regex",) and not store.rejected
    info = store.load("regex")
    assert info.modules == store.info("regex").modules
    assert {m.rsplit(".", 1)[-1] for m in info.modules} == {"q_proj", "v_proj"}
    assert info.config["target_modules"] == pattern


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("target_modules", "(a+)+", "repeats a group"),
        ("target_modules", "x" * 300, "more than 256"),
        ("exclude_modules", r"(\w+)\1", "backreference"),
        ("rank_pattern", {".*.*.*": 4}, "backtracking"),
        ("layers_pattern", ["(.*)(.*)"], "backtracking"),
    ],
)
def test_other_regex_fields_are_bounded(base, adapter_root, tmp_path, field, value, why) -> None:
    def edit(config: dict) -> None:
        config[field] = value
        if field == "layers_pattern":
            config["layers_to_transform"] = [0]

    bad = _with_config(adapter_root / "attn", tmp_path / "bad", edit)
    store = AdapterStore(base)
    with pytest.raises(InvalidAdapter, match=why) as caught:
        store.register("bad", bad)
    assert field in str(caught.value)


DEEP = "[" * 200_000 + "]" * 200_000
MALFORMED = {
    # case: (config edit or raw text, error type, what the message says)
    "alpha_word": (lambda c: c.update(lora_alpha="sixteen"), InvalidAdapter, "lora_alpha"),
    "alpha_huge": (lambda c: c.update(lora_alpha=10**400), InvalidAdapter, "lora_alpha"),
    "alpha_inf": (lambda c: c.update(lora_alpha=float("inf")), InvalidAdapter, "lora_alpha"),
    "rank_huge": (lambda c: c.update(r=10**4000), RankTooHigh, "above the limit"),
    "rank_word": (lambda c: c.update(r="four"), InvalidAdapter, "field r must be an int"),
    "rank_pattern_list": (lambda c: c.update(rank_pattern=[4]), InvalidAdapter, "rank_pattern"),
    "targets_number": (lambda c: c.update(target_modules=5), InvalidAdapter, "target_modules"),
    "bad_regex": (lambda c: c.update(target_modules="("), InvalidAdapter, "not a valid regular"),
    "deep_json": (DEEP, InvalidAdapter, "nested too deeply"),
    "deep_field": (
        lambda c: c.update(alpha_pattern=json.loads("[" * 40 + "]" * 40)),
        InvalidAdapter,
        "deeper than",
    ),
    "many_digits": ('{"r": ' + "7" * 5000 + "}", InvalidAdapter, "Exceeds the limit"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_configs_are_adapter_errors(base, adapter_root, tmp_path, case) -> None:
    change, error_type, says = MALFORMED[case]
    if isinstance(change, str):
        bad = _with_config(adapter_root / "attn", tmp_path / case, text=change)
    else:
        bad = _with_config(adapter_root / "attn", tmp_path / case, change)
    store = AdapterStore(base, root=tmp_path)
    assert set(store.rejected) == {case} and store.names() == ()
    with pytest.raises(error_type, match=says) as caught:
        store.register(case, bad)
    message = str(caught.value)
    assert f"adapter {case!r}" in message and CONFIG_FILE in message
    assert len(message) < 1000  # a 4,000-digit value is cut, not echoed
    assert store.names() == ()


def test_validation_runs_outside_the_store_lock(base, adapter_root, monkeypatch) -> None:
    """While an adapter is validated (or its weights read), another thread can take the lock."""
    store = AdapterStore(base)
    free_during: list[bool] = []
    real = store_module.validate_adapter

    def probe() -> None:
        acquired = store._lock.acquire(timeout=2)
        if acquired:
            store._lock.release()
        free_during.append(acquired)

    def observed(*args, **kwargs):
        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        return real(*args, **kwargs)

    monkeypatch.setattr(store_module, "validate_adapter", observed)
    store.register("attn", adapter_root / "attn")
    store.load("attn")
    assert free_during == [True, True]
