"""Medusa heads in FasterDecoding's layout (the Medusa paper's code), into selfspec.

A FasterDecoding Medusa directory holds ``config.json`` with ``medusa_num_heads``,
``medusa_num_layers`` and ``base_model_name_or_path``, and ``medusa_lm_head.safetensors`` (older
ones only ``medusa_lm_head.pt``, a pickle: refused) with the state of a ModuleList of
``nn.Sequential(ResBlock x L, Linear(H, vocab, bias=False))``: ``{i}.{j}.linear.weight`` /
``.bias`` for residual block j of head i (``x + silu(linear(x))``, selfspec's ResidualBlock) and
``{i}.{L}.weight`` for head i's own lm_head. Head i reads the target's last (final-normed)
hidden state and predicts token t+i+2, as selfspec's Medusa head i does.

selfspec's Medusa heads project through the target's own lm_head. A head whose lm_head is not
the base's (Medusa-2, or Medusa-1 trained with its lm_heads unfrozen) has no selfspec
counterpart and is refused, named; FasterDecoding initialises them as copies of the base's, so
heads trained with the lm_heads frozen import exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from selfspec.heads.config import HeadKind, HeadsConfig
from selfspec.interop.errors import InteropError

WEIGHTS_STEM = "medusa_lm_head"


@dataclass(frozen=True)
class MedusaLayout:
    """What a FasterDecoding config.json says."""

    num_heads: int
    num_layers: int
    base_name: str | None
    """``base_model_name_or_path``: the base the heads were trained on, as its authors named it."""


def read_layout(data: dict[str, Any], what: str) -> MedusaLayout:
    """Read a FasterDecoding Medusa config.json; raise `InteropError` on missing or bad keys."""
    values = {}
    for key in ("medusa_num_heads", "medusa_num_layers"):
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InteropError(
                f"{what}: config.json needs an integer {key} (a FasterDecoding Medusa config), "
                f"got {value!r}"
            )
        values[key] = value
    if values["medusa_num_heads"] < 1:
        raise InteropError(f"{what}: medusa_num_heads must be >= 1")
    if values["medusa_num_layers"] < 1:
        raise InteropError(
            f"{what}: medusa_num_layers={values['medusa_num_layers']}; selfspec's Medusa heads "
            "have at least one residual block"
        )
    base = data.get("base_model_name_or_path")
    return MedusaLayout(
        num_heads=values["medusa_num_heads"],
        num_layers=values["medusa_num_layers"],
        base_name=base if isinstance(base, str) else None,
    )


def import_tensors(
    layout: MedusaLayout,
    tensors: dict[str, torch.Tensor],
    what: str,
    lm_head: torch.Tensor,  # [vocab, H] the base's lm_head weight
) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    """FasterDecoding tensors -> selfspec Medusa config and state (float32)."""
    vocab, hidden = (int(n) for n in lm_head.shape)
    expected: dict[str, tuple[int, ...]] = {}
    for head in range(layout.num_heads):
        for block in range(layout.num_layers):
            expected[f"{head}.{block}.linear.weight"] = (hidden, hidden)
            expected[f"{head}.{block}.linear.bias"] = (hidden,)
        expected[f"{head}.{layout.num_layers}.weight"] = (vocab, hidden)
    found = {name: tuple(t.shape) for name, t in tensors.items()}
    if found != expected:
        missing = sorted(set(expected) - set(found))
        unexpected = sorted(set(found) - set(expected))
        wrong = sorted(
            f"{n} {found[n]} (expected {expected[n]})"
            for n in set(expected) & set(found)
            if expected[n] != found[n]
        )
        raise InteropError(
            f"{what}: the weights do not match medusa_num_heads={layout.num_heads}, "
            f"medusa_num_layers={layout.num_layers} on a base of hidden size {hidden} and "
            f"vocabulary {vocab}: missing {missing}, unexpected {unexpected}, wrong shape {wrong}"
        )
    for name, tensor in tensors.items():
        if not tensor.dtype.is_floating_point:
            raise InteropError(f"{what}: {name} must be floating point, got {tensor.dtype}")
    for head in range(layout.num_heads):
        _check_lm_head(head, tensors[f"{head}.{layout.num_layers}.weight"], lm_head, what)
    state = {
        f"heads.{head}.{block}.linear.{part}": tensors[f"{head}.{block}.linear.{part}"]
        .to(torch.float32)
        .contiguous()
        for head in range(layout.num_heads)
        for block in range(layout.num_layers)
        for part in ("weight", "bias")
    }
    config = HeadsConfig(
        kind=HeadKind.MEDUSA,
        hidden_size=hidden,
        vocab_size=vocab,
        num_heads=layout.num_heads,
        num_layers=layout.num_layers,
    )
    return config, state


def _check_lm_head(head: int, own: torch.Tensor, base: torch.Tensor, what: str) -> None:
    reference = base.detach().to("cpu", own.dtype)  # compared in the checkpoint's precision
    if torch.equal(own, reference):
        return
    gap = float((own.float() - reference.float()).abs().max())
    raise InteropError(
        f"{what}: Medusa head {head} has its own lm_head, which differs from the base's "
        f"(max |diff| {gap:.3g}); selfspec's Medusa heads project through the target's lm_head, "
        "so these drafts cannot be reproduced (heads trained with the lm_heads frozen import; "
        "is --base the model they were trained on?)"
    )
