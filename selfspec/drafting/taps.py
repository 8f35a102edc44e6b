"""Layer taps: the target's hidden states at chosen layers, read during a forward it runs anyway.

EAGLE-3 heads read the residual stream entering a few decoder layers (HF's
``output_hidden_states[k]``), not only the last hidden state. ``LayerTaps.capture()`` registers
forward pre-hooks for the duration of one forward and removes them afterwards: nothing stays on
the target's modules between calls, and the forward's arithmetic is untouched (a pre-hook only
reads its input).

Where the state is read: the first norm of decoder layer k (``input_layernorm``, GPT-2's
``ln_1``), which both transformers' layer code and ``selfspec.lean_body`` call as a module with
exactly that stream; index L is, as in HF, the final norm's output (the last hidden state). A
body that computed a layer without calling its norm module would leave the tap empty, and
``TapRecord.stacked`` says so instead of returning something wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from selfspec.reader_hooks import mark_reader

_LAYER_NORMS = ("input_layernorm", "ln_1")
_FINAL_NORMS = ("norm", "ln_f", "final_layernorm")


class LayerTapError(ValueError):
    """A requested layer cannot be tapped on this body, or its state was not seen in a forward."""


def decoder_layers(body: nn.Module) -> Sequence[nn.Module]:
    """The decoder layers of an HF body (``layers`` in Llama-like bodies, ``h`` in GPT-2)."""
    for name in ("layers", "h"):
        layers = getattr(body, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise LayerTapError(f"{type(body).__name__} has no decoder layer list (layers / h) to tap")


@dataclass
class TapRecord:
    """What one forward showed the taps. ``states[k]``: # [B, S, H]"""

    layers: tuple[int, ...]
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    def stacked(self) -> torch.Tensor:
        """The tapped states concatenated in ``layers`` order. # [B, S, len(layers) * H]"""
        missing = [k for k in dict.fromkeys(self.layers) if k not in self.states]
        if missing:
            raise LayerTapError(
                f"the forward never entered the tapped layer(s) {missing}: the body ran them "
                "without calling their input norm module, so EAGLE-3 heads cannot read them"
            )
        return torch.cat([self.states[k] for k in self.layers], dim=-1)


class LayerTaps:
    """Taps on ``layers`` (indices into HF's ``output_hidden_states``, 0..L) of a decoder body.

    Holds references to the body's modules only; every forward gets its own ``TapRecord``."""

    def __init__(self, body: nn.Module, layers: Sequence[int]) -> None:
        self.layers = tuple(int(k) for k in layers)
        if not self.layers:
            raise ValueError("LayerTaps needs at least one layer index")
        blocks = decoder_layers(body)
        count = self._count = len(blocks)
        bad = [k for k in self.layers if not 0 <= k <= count]
        if bad:
            raise LayerTapError(
                f"layer indices {bad} are out of range for a body of {count} decoder layers "
                f"(0..{count}: the stream entering layer k; {count}: the final norm's output)"
            )
        self._tapped: dict[int, nn.Module] = {}
        for k in dict.fromkeys(self.layers):
            if k < count:
                self._tapped[k] = _first_child(blocks[k], _LAYER_NORMS) or blocks[k]
                continue
            final = _first_child(body, _FINAL_NORMS)
            if final is None:
                raise LayerTapError(
                    f"{type(body).__name__} has no final norm ({', '.join(_FINAL_NORMS)}) "
                    f"to tap layer index {count} at"
                )
            self._tapped[k] = final

    @contextlib.contextmanager
    def capture(self) -> Iterator[TapRecord]:
        """Record the tapped states of the forwards run inside; each layer's last call wins."""
        record = TapRecord(self.layers)
        handles = []
        try:
            for k, module in self._tapped.items():
                if k == self._count:  # HF's last entry is the final norm's output
                    handles.append(module.register_forward_hook(_output_recorder(record, k)))
                else:
                    handles.append(
                        module.register_forward_pre_hook(_recorder(record, k), with_kwargs=True)
                    )
            yield record
        finally:
            for handle in handles:
                handle.remove()


def _first_child(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    """The first of ``names`` that ``module`` has. Without one, a decoder layer is tapped itself
    (its pre-hook sees the stream as its first argument or ``hidden_states``)."""
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return child
    return None


def _recorder(record: TapRecord, layer: int):
    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        stream = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(stream, torch.Tensor):
            raise LayerTapError(f"tapped layer {layer} was called without a hidden-state tensor")
        record.states[layer] = stream

    return mark_reader(hook)  # a fused body may hand it the stream itself


def _output_recorder(record: TapRecord, layer: int):
    def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        record.states[layer] = output

    return mark_reader(hook)


@contextlib.contextmanager
def maybe_capture(taps: LayerTaps | None) -> Iterator[TapRecord | None]:
    """``taps.capture()``, or nothing (None) for drafters that read only the last hidden state."""
    if taps is None:
        yield None
    else:
        with taps.capture() as record:
            yield record


def taps_for(drafter: object, body: nn.Module) -> LayerTaps | None:
    """The taps a drafter needs on the target's body: None for drafters that read the last
    hidden state only (no ``target_layers``, or an empty one)."""
    layers = tuple(getattr(drafter, "target_layers", ()) or ())
    return LayerTaps(body, layers) if layers else None
