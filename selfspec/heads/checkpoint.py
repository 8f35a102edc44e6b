"""Heads checkpoints: ``config.json`` + ``model.safetensors`` in one directory.

config.json records the heads config and the fingerprint of the base they were trained on;
loading onto another base is refused with a message naming both. Writes are atomic: the
directory is assembled under a temporary name and renamed into place, so a reader sees the old
checkpoint or the new one, never a mix.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from selfspec.atomic import replace_dir, staging_dir_for
from selfspec.fingerprint import BaseFingerprint, check_compatible, fingerprint_of
from selfspec.heads.config import HeadsConfig
from selfspec.heads.draft_vocab import BUFFER, check_draft_vocab
from selfspec.heads.factory import DraftHeads, build_heads
from selfspec.packed_linear import is_packed, pack_linears

FORMAT = "selfspec-heads"
VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class HeadsCheckpointError(ValueError):
    """A heads checkpoint that is missing, malformed, or does not fit."""


def save_heads(
    heads: DraftHeads,
    path: str | os.PathLike[str],
    base: BaseFingerprint,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write heads atomically; ``extra`` (JSON-serialisable, e.g. training metrics) is kept."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "format": FORMAT,
        "version": VERSION,
        "heads": heads.config.to_dict(),
        "base": base.to_dict(),
        "extra": extra or {},
    }
    staging = staging_dir_for(path)
    try:
        state = {  # floats as float32; integer buffers (the draft vocabulary) as they are
            name: t.detach()
            .to("cpu", torch.float32 if t.is_floating_point() else t.dtype)
            .contiguous()
            for name, t in heads.state_dict().items()
        }
        save_file(state, str(staging / WEIGHTS_FILE))
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        replace_dir(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def read_heads_config(
    path: str | os.PathLike[str],
) -> tuple[HeadsConfig, BaseFingerprint, dict[str, Any]]:
    """Parse and validate config.json without touching the weights."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not path.is_dir():
        raise HeadsCheckpointError(f"heads checkpoint {path} is not a directory")
    if not config_path.is_file():
        raise HeadsCheckpointError(f"heads checkpoint {path} has no {CONFIG_FILE}")
    try:
        data = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HeadsCheckpointError(f"{config_path} is not valid JSON: {error}") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise HeadsCheckpointError(
            f"{config_path} is not a selfspec heads config (format != {FORMAT!r})"
        )
    if data.get("version") != VERSION:
        raise HeadsCheckpointError(
            f"{config_path} has version {data.get('version')}, expected {VERSION}"
        )
    try:
        heads_config = HeadsConfig.from_dict(data["heads"])
        base = BaseFingerprint.from_dict(data["base"])
    except (KeyError, TypeError, ValueError) as error:
        raise HeadsCheckpointError(
            f"{config_path} has an invalid heads/base section: {error}"
        ) from error
    return heads_config, base, dict(data.get("extra") or {})


def load_heads(
    path: str | os.PathLike[str],
    target: PreTrainedModel | None = None,
    dtype: torch.dtype | None = None,
) -> DraftHeads:
    """Load heads; with ``target`` given, refuse a base other than the one they were trained on.

    The heads are returned in eval mode, frozen, on the target's device and dtype (or ``dtype``),
    with packed linear weights if the target has them (`selfspec.packed_linear`).
    """
    path = Path(path)
    heads_config, base, _ = read_heads_config(path)
    if target is not None:
        check_compatible(base, fingerprint_of(target), what=f"heads at {path}")
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise HeadsCheckpointError(f"heads checkpoint {path} has no {WEIGHTS_FILE}")
    try:
        state = load_file(str(weights_path))
    except (SafetensorError, OSError) as error:
        raise HeadsCheckpointError(
            f"{weights_path} is not a readable safetensors file: {error}"
        ) from error
    heads = build_heads(heads_config)
    expected = {name: tuple(t.shape) for name, t in heads.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in state.items()}
    if expected != found:
        missing = sorted(set(expected) - set(found))
        unexpected = sorted(set(found) - set(expected))
        wrong = sorted(n for n in set(expected) & set(found) if expected[n] != found[n])
        raise HeadsCheckpointError(
            f"{weights_path} does not match its config: missing {missing}, "
            f"unexpected {unexpected}, wrong shape {wrong}"
        )
    try:
        vocab = state.get(BUFFER)
        if vocab is not None:
            state[BUFFER] = check_draft_vocab(
                vocab, heads_config.vocab_size, heads_config.draft_vocab_size
            )
        check_state = getattr(type(heads), "check_state", None)  # a kind's own invariants
        if check_state is not None:
            check_state(state, heads_config)
    except ValueError as error:
        raise HeadsCheckpointError(f"{weights_path}: {error}") from error
    heads.load_state_dict(state)
    if target is not None:
        embed = target.get_input_embeddings().weight
        heads.to(device=embed.device, dtype=dtype or embed.dtype)
        if dtype in (None, embed.dtype) and is_packed(target):  # heads run like their target
            pack_linears(heads)
    elif dtype is not None:
        heads.to(dtype=dtype)
    heads.eval().requires_grad_(False)
    return heads
