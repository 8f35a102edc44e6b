"""Which module class implements each head kind.

Each head module registers its class (``@register_heads(HeadKind.X)``); the factory imports the
head modules and builds through ``heads_class``. Nothing here imports a head module, so the head
modules, the draft-vocabulary helpers and the factory import each other in one direction only:
config <- registry <- heads modules <- factory <- checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

from selfspec.heads.config import HeadKind

_CLASSES: dict[HeadKind, type[nn.Module]] = {}

ModuleType = TypeVar("ModuleType", bound=type[nn.Module])


def register_heads(kind: HeadKind) -> Callable[[ModuleType], ModuleType]:
    """Class decorator: ``cls(config)`` builds heads of ``kind``. One class per kind."""

    def register(cls: ModuleType) -> ModuleType:
        known = _CLASSES.get(kind)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"heads kind {kind.value!r} is already {known.__qualname__}")
        _CLASSES[kind] = cls
        return cls

    return register


def heads_class(kind: HeadKind | str) -> type[nn.Module]:
    """The registered class of ``kind``; an unknown or unregistered kind is a clear error."""
    kind = HeadKind(kind)
    try:
        return _CLASSES[kind]
    except KeyError:
        raise ValueError(
            f"no heads class registered for kind {kind.value!r} (registered: "
            f"{sorted(k.value for k in _CLASSES)}); import selfspec.heads.factory"
        ) from None


def is_heads_module(module: object) -> bool:
    """Whether ``module`` is heads of any registered kind."""
    return isinstance(module, tuple(_CLASSES.values()))
