"""Directories: selfspec heads <-> speculators EAGLE-3, FasterDecoding Medusa -> selfspec heads.

The format modules map configs and tensors; here the directories are read, the base is checked
(its fingerprint against the heads' record; its sizes against the imported drafter's), and the
result is written atomically: complete or absent.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from selfspec.fingerprint import BaseFingerprint, check_compatible, fingerprint_of
from selfspec.heads.checkpoint import load_heads, read_heads_config, save_heads
from selfspec.heads.factory import DraftHeads, build_heads
from selfspec.interop import medusa, speculators
from selfspec.interop.errors import InteropError
from selfspec.interop.files import check_destination, read_json, read_weights, write_checkpoint
from selfspec.interop.speculators import Verifier

SPECULATORS_WEIGHTS = "model.safetensors"


def export_speculators(
    heads_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    base: PreTrainedModel | None = None,
    verifier_name: str | None = None,
    speculative_tokens: int = 3,
    overwrite: bool = False,
    embedding: bool | None = None,
) -> Path:
    """Write selfspec EAGLE-3 heads as a speculators drafter directory ``out``.

    ``base`` (optional) must be the base the heads were trained on (fingerprint checked); its
    context length goes into the config, and with ``embedding`` (default: when ``base`` is
    given) its token embedding, as speculators itself saves drafters. ``verifier_name`` is
    recorded as the verifier's ``name_or_path`` (the HF id or path loaders resolve)."""
    heads_dir, out = Path(heads_dir), Path(out)
    config, fingerprint, extra = read_heads_config(heads_dir)
    speculators.check_exportable(config)  # before reading any weights
    check_destination(out, overwrite, [heads_dir])
    embedding = base is not None if embedding is None else embedding
    if embedding and base is None:
        raise InteropError("exporting the token embedding needs the base it comes from")
    max_positions = None
    if base is not None:
        check_compatible(fingerprint, fingerprint_of(base), what=f"heads at {heads_dir}")
        max_positions = getattr(base.config, "max_position_embeddings", None)
    heads = load_heads(heads_dir)  # float32 on the CPU, as stored
    verifier = Verifier(
        name_or_path=verifier_name,
        architectures=(fingerprint.architecture,),
        max_position_embeddings=max_positions,
    )
    record = {"heads": config.to_dict(), "base": fingerprint.to_dict(), "extra": extra}
    data = speculators.export_config(config, verifier, speculative_tokens, record)
    tensors = speculators.export_tensors(config, heads.state_dict())
    if embedding and base is not None:
        weight = base.get_input_embeddings().weight  # [vocab, H]
        tensors[speculators.EMBEDDING] = weight.detach().to("cpu", torch.float32).contiguous()
    return write_checkpoint(out, data, tensors, SPECULATORS_WEIGHTS)


def import_speculators(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    base: PreTrainedModel,
    base_name: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the speculators EAGLE-3 drafter at ``source`` as selfspec heads for ``base``."""
    source, out = Path(source), Path(out)
    what = f"speculators checkpoint {source}"
    _check_source_dir(source, what)
    check_destination(out, overwrite, [source])
    fingerprint = fingerprint_of(base)
    drafter = speculators.import_config(
        read_json(source / "config.json", what), what, fingerprint.num_layers
    )
    _check_base(drafter, fingerprint, what)
    tensors = read_weights(source, Path(SPECULATORS_WEIGHTS).stem, what)
    state = speculators.import_tensors(
        drafter.heads, tensors, what, base.get_input_embeddings().weight
    )
    heads = _build(drafter.heads, state, what)
    imported = {
        "format": "speculators",
        "source": str(source.resolve()),
        "speculators_version": drafter.speculators_version,
        "verifier": drafter.verifier.name_or_path,
        "speculative_tokens": drafter.speculative_tokens,
        "base": base_name,
    }
    extra = {**dict(drafter.record.get("extra") or {}), "imported_from": imported}
    return save_heads(heads, out, fingerprint, extra)


def import_medusa(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    base: PreTrainedModel,
    base_name: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the FasterDecoding Medusa heads at ``source`` as selfspec Medusa heads for ``base``."""
    source, out = Path(source), Path(out)
    what = f"Medusa checkpoint {source}"
    _check_source_dir(source, what)
    check_destination(out, overwrite, [source])
    layout = medusa.read_layout(read_json(source / "config.json", what), what)
    tensors = read_weights(source, medusa.WEIGHTS_STEM, what)
    lm_head = base.get_output_embeddings()
    if lm_head is None or getattr(lm_head, "bias", None) is not None:
        raise InteropError(f"{what}: the base needs an lm_head without bias, as Medusa's")
    config, state = medusa.import_tensors(layout, tensors, what, lm_head.weight)
    heads = _build(config, state, what)
    imported = {
        "format": "medusa (FasterDecoding)",
        "source": str(source.resolve()),
        "base_model_name_or_path": layout.base_name,
        "base": base_name,
    }
    return save_heads(heads, out, fingerprint_of(base), {"imported_from": imported})


def _check_source_dir(source: Path, what: str) -> None:
    if not source.is_dir():
        raise InteropError(f"{what} is not a directory")


def _check_base(
    drafter: speculators.SpeculatorsDrafter, fingerprint: BaseFingerprint, what: str
) -> None:
    """The base given is one the drafter fits: sizes, architecture, and (for a selfspec export)
    the very base it was trained on."""
    heads = drafter.heads
    for name, drafter_value, base_value in (
        ("hidden size", heads.hidden_size, fingerprint.hidden_size),
        ("vocabulary size", heads.vocab_size, fingerprint.vocab_size),
    ):
        if drafter_value != base_value:
            raise InteropError(
                f"{what} is for a base of {name} {drafter_value}; the given base "
                f"({fingerprint.describe()}) has {base_value}"
            )
    architectures = drafter.verifier.architectures
    if architectures and fingerprint.architecture not in architectures:
        raise InteropError(
            f"{what} is for a base of architecture {', '.join(architectures)}; the given base is "
            f"{fingerprint.architecture}"
        )
    recorded: dict[str, Any] | None = drafter.record.get("base")
    if recorded is not None:
        try:
            made_for = BaseFingerprint.from_dict(recorded)
        except (TypeError, ValueError) as error:
            raise InteropError(f"{what}: selfspec.base is invalid: {error}") from error
        check_compatible(made_for, fingerprint, what=what)


def _build(config: Any, state: dict[str, Any], what: str) -> DraftHeads:
    """Heads holding ``state``, its invariants checked as a selfspec checkpoint's are."""
    heads = build_heads(config)
    try:
        check_state = getattr(type(heads), "check_state", None)
        if check_state is not None:
            check_state(state, config)
        heads.load_state_dict(state)
    except (RuntimeError, ValueError) as error:
        raise InteropError(f"{what}: {error}") from error
    return heads.eval()
