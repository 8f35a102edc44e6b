"""The store under bad folders: a scan never aborts, failures reserve no name, the base model's
name is kept, hard links are refused under a root, and clients see root-relative paths."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import selfspec.adapters.store as store_module
from selfspec.adapters.errors import (
    AdapterPathError,
    CorruptAdapter,
    InvalidAdapter,
    ReservedAdapterName,
)
from selfspec.adapters.store import AdapterStore
from selfspec.adapters.validate import CONFIG_FILE, WEIGHTS_FILE


def _edit_config(directory: Path, **fields: object) -> Path:
    config = json.loads((directory / CONFIG_FILE).read_text())
    (directory / CONFIG_FILE).write_text(json.dumps({**config, **fields}))
    return directory


@pytest.fixture
def mixed_root(adapter_root: Path, tmp_path: Path) -> Path:
    """One good adapter beside bad ones that each used to abort a scan or stall it."""
    root = tmp_path / "root"
    root.mkdir()
    good = adapter_root / "attn"
    shutil.copytree(good, root / "good")
    _edit_config(shutil.copytree(good, root / "bad_regex"), target_modules="(.*)(.*)(.*)(.*)X")
    _edit_config(shutil.copytree(good, root / "invalid_regex"), target_modules="(")
    shutil.copytree(good, root / "deep_json")
    (root / "deep_json" / CONFIG_FILE).write_text("[" * 200_000 + "]" * 200_000)
    shutil.copytree(good, root / "huge_int")
    (root / "huge_int" / CONFIG_FILE).write_text('{"lora_alpha": ' + "9" * 5000 + "}")
    _edit_config(shutil.copytree(good, root / "alpha_word"), lora_alpha="sixteen")
    shutil.copytree(good, root / "surprise")  # made to fail unexpectedly below
    (root / "not_an_adapter.txt").write_text("a file, not a folder: skipped silently")
    return root


def test_scan_registers_the_good_and_records_every_bad_reason(base, mixed_root, monkeypatch):
    real = store_module.validate_adapter

    def surprising(name, *args, **kwargs):
        if name == "surprise":
            raise RuntimeError("something nobody foresaw")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(store_module, "validate_adapter", surprising)
    store = AdapterStore(base, root=mixed_root)
    assert store.names() == ("good",)
    reasons = store.rejected
    assert set(reasons) == {
        "bad_regex", "invalid_regex", "deep_json", "huge_int", "alpha_word", "surprise"
    }
    assert "backtracking" in reasons["bad_regex"]
    assert "not a valid regular expression" in reasons["invalid_regex"]
    assert "nested too deeply" in reasons["deep_json"]
    assert "Exceeds the limit" in reasons["huge_int"]
    assert "lora_alpha" in reasons["alpha_word"]
    assert reasons["surprise"] == "unexpected RuntimeError: something nobody foresaw"
    assert all(str(mixed_root) not in why for why in reasons.values())
    store.load("good")


def test_scan_survives_an_unreadable_config(base, adapter_root, tmp_path, monkeypatch) -> None:
    shutil.copytree(adapter_root / "attn", tmp_path / "good")
    shutil.copytree(adapter_root / "attn", tmp_path / "locked")
    read_text = Path.read_text

    def denied(self: Path, *args, **kwargs) -> str:
        if self.parent.name == "locked":  # as chmod 000 would, even when the tests run as root
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    store = AdapterStore(base, root=tmp_path)
    assert store.names() == ("good",)
    assert "adapter_config.json cannot be read: Permission denied" in store.rejected["locked"]
    assert str(tmp_path) not in store.rejected["locked"]


def test_a_failed_register_leaves_the_name_free(base, adapter_root, tmp_path) -> None:
    bad = _edit_config(shutil.copytree(adapter_root / "attn", tmp_path / "bad"), r="four")
    store = AdapterStore(base, root=tmp_path)
    assert "bad" in store.rejected
    with pytest.raises(InvalidAdapter, match="field r must be an int"):
        store.register("bad", bad)
    assert "bad" not in store.names()
    good = shutil.copytree(adapter_root / "attn", tmp_path / "good")
    assert store.register("bad", good).path == good.resolve()
    assert "bad" not in store.rejected  # the name now means the good adapter
    store.load("bad")
    assert store.resident() == ("bad",)


def test_a_failed_load_changes_nothing_and_a_fixed_adapter_then_loads(
    base, adapter_root, tmp_path
) -> None:
    adapter = shutil.copytree(adapter_root / "attn", tmp_path / "fixable")
    store = AdapterStore(base, root=tmp_path)
    weights = (adapter / WEIGHTS_FILE).read_bytes()
    (adapter / WEIGHTS_FILE).write_bytes(weights[:100])
    with pytest.raises(CorruptAdapter):
        store.load("fixable")
    assert store.resident() == () and store.names() == ("fixable",)
    (adapter / WEIGHTS_FILE).write_bytes(weights)
    store.load("fixable")
    assert store.resident() == ("fixable",)


def test_the_base_models_name_is_reserved(base, adapter_root, tmp_path) -> None:
    shutil.copytree(adapter_root / "attn", tmp_path / "tiny-llama")
    shutil.copytree(adapter_root / "attn", tmp_path / "attn")
    store = AdapterStore(base, root=tmp_path, base_name="tiny-llama")
    assert store.names() == ("attn",)
    assert "base model's name" in store.rejected["tiny-llama"]
    with pytest.raises(ReservedAdapterName, match="'tiny-llama' is the base model's name"):
        store.register("tiny-llama", tmp_path / "attn")
    with pytest.raises(ReservedAdapterName):
        AdapterStore(base, adapters={"tiny-llama": adapter_root / "attn"}, base_name="tiny-llama")
    # Without a base name nothing is reserved (the default, as before).
    assert "tiny-llama" in AdapterStore(base, root=tmp_path).names()


def _hard_link_or_skip(source: Path, link: Path) -> None:
    try:
        os.link(source, link)
    except OSError as error:
        pytest.skip(f"this filesystem refuses hard links: {error}")


@pytest.mark.parametrize("filename", [WEIGHTS_FILE, CONFIG_FILE])
def test_hard_links_inside_the_root_are_refused(base, adapter_root, tmp_path, filename) -> None:
    outside = shutil.copytree(adapter_root / "attn", tmp_path / "outside")
    root = tmp_path / "root"
    linked = shutil.copytree(adapter_root / "attn", root / "linked")
    (linked / filename).unlink()
    _hard_link_or_skip(outside / filename, linked / filename)
    store = AdapterStore(base, root=root)
    assert store.names() == ()
    assert "hard link" in store.rejected["linked"]
    with pytest.raises(AdapterPathError, match=f"{filename} is a hard link"):
        store.register("linked", linked)
    # Without a root the operator named the directory; there is no fence to cross.
    assert AdapterStore(base, adapters={"linked": linked}).names() == ("linked",)


def test_display_path_is_relative_to_the_root(base, adapter_root, tmp_path) -> None:
    shutil.copytree(adapter_root / "attn", tmp_path / "attn")
    nested = shutil.copytree(adapter_root / "mlp_down", tmp_path / "team" / "mlp")
    store = AdapterStore(base, root=tmp_path, adapters={"team-mlp": nested})
    assert store.info("attn").display_path == "attn"
    assert store.info("team-mlp").display_path == "team/mlp"
    assert store.info("attn").to_dict()["display_path"] == "attn"
    rootless = AdapterStore(base, adapters={"mine": adapter_root / "attn"})
    assert rootless.info("mine").display_path == "mine"


def test_errors_name_paths_relative_to_the_root(base, adapter_root, tmp_path) -> None:
    root = tmp_path / "root"
    bad = _edit_config(shutil.copytree(adapter_root / "attn", root / "team" / "bad"), r=0)
    escape = root / "escape"
    escape.symlink_to(adapter_root / "attn", target_is_directory=True)
    linked = shutil.copytree(adapter_root / "attn", root / "linked")
    (linked / WEIGHTS_FILE).unlink()
    (linked / WEIGHTS_FILE).symlink_to(adapter_root / "attn" / WEIGHTS_FILE)
    store = AdapterStore(base, root=root)
    messages = []
    # As a client gives them: relative to the root. Errors echo that, never a resolved target.
    for name, path in (("bad", "team/bad"), ("escape", "escape"), ("linked", "linked")):
        with pytest.raises(InvalidAdapter if name == "bad" else AdapterPathError) as caught:
            store.register(name, path)
        messages.append(str(caught.value))
    assert "adapter 'bad' (team/bad)" in messages[0]
    with pytest.raises(InvalidAdapter, match=r"adapter 'bad' \(team/bad\)"):
        store.register("bad", bad)  # an absolute path inside the root is shown relative too
    for message in messages:
        assert str(tmp_path) not in message and str(adapter_root) not in message, message
