"""Forward pre-hooks that only read their input, marked so that a fused body can serve them.

A hook on a module normally keeps the fused paths (``selfspec.fused_layer``,
``selfspec.lean_body``) from computing that module's work their own way: they cannot know what
the hook does. A hook marked with ``mark_reader`` promises to only read the stream it is given
(EAGLE-3's layer taps, ``selfspec.drafting.taps``), so a body may compute the module's work its
own way and call the hook with the same stream: ``hook(module, (stream,), {})`` before it,
``hook(module, (stream,), output)`` after it.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

_READER = "_selfspec_reader_hook"


def mark_reader(hook: Callable) -> Callable:
    """Mark ``hook`` as one that only reads: a pre-hook registered ``with_kwargs=True``, or a
    forward hook."""
    setattr(hook, _READER, True)
    return hook


def reader_hooks(module: nn.Module) -> tuple[list[Callable], list[Callable]] | None:
    """(pre-hooks, forward hooks) on ``module`` if every hook on it is a marked reader, else
    None. Two empty lists: no hooks at all."""
    if getattr(module, "_backward_hooks", None):
        return None
    before = list(module._forward_pre_hooks.values())
    after = list(module._forward_hooks.values())
    if all(getattr(hook, _READER, False) for hook in before + after):
        return before, after
    return None
