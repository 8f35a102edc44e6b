"""Pick one adapter for a command-line run: a directory, or a name under a root."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from selfspec.adapters.shipped import examples_root
from selfspec.adapters.store import AdapterStore, StepScope


def store_for(
    model: PreTrainedModel, adapters_root: str | None, is_default_target: bool
) -> AdapterStore:
    """A store over `adapters_root`; without one, over the shipped examples (default target
    only), else an empty store that takes adapter directories."""
    if adapters_root is not None:
        return AdapterStore(model, root=adapters_root)
    shipped = examples_root() if is_default_target else None
    return AdapterStore(model, root=shipped) if shipped is not None else AdapterStore(model)


def select_adapter(
    model: PreTrainedModel,
    adapter: str | None,
    adapters_root: str | None = None,
    is_default_target: bool = False,
) -> tuple[AdapterStore | None, str | None, StepScope | None]:
    """(store, adapter name, step scope) for `--adapter NAME_OR_DIR`; all None without one.

    A directory given with no `--adapters-root` is used as is (the operator named it); a name is
    looked up under `--adapters-root`, or among the shipped examples for the default target."""
    if adapter is None:
        return None, None, None
    if adapters_root is None and Path(adapter).expanduser().is_dir():
        directory = Path(adapter).expanduser().resolve()
        store = AdapterStore(model, adapters={directory.name: directory})
        name = directory.name
    else:
        store = store_for(model, adapters_root, is_default_target)
        name = store.resolve(adapter)
    store.load(name)
    return store, name, store.scope(name)
