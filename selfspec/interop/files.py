"""Another project's checkpoint directory: JSON and safetensors only, never a pickle.

A pickle (``.bin``, ``.pt``) can run code when it is loaded, so a directory that has only pickled
weights is refused with a message naming the files, not read. Output directories are written
like selfspec's own checkpoints: assembled beside the destination and renamed into place.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from selfspec.atomic import replace_dir, staging_dir_for
from selfspec.interop.errors import InteropError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path``; a missing file, bad JSON or a non-object is an error."""
    if not path.is_file():
        raise InteropError(f"{what}: no {path.name} in {path.parent}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InteropError(f"{what}: {path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise InteropError(f"{what}: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_weights(directory: Path, stem: str, what: str) -> dict[str, torch.Tensor]:
    """Tensors of ``{stem}.safetensors``, or of the shards ``{stem}.safetensors.index.json``
    lists; pickled weights alone are refused."""
    single = directory / f"{stem}.safetensors"
    index = directory / f"{stem}.safetensors.index.json"
    if single.is_file():
        return _load(single, what)
    if index.is_file():
        return _load_shards(directory, read_json(index, what), what)
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise InteropError(
            f"{what}: {directory} has only pickled weights ({', '.join(pickles)}), which "
            f"selfspec does not load (unpickling can run code); save them as {stem}.safetensors "
            "with a tool you trust, then import that"
        )
    raise InteropError(f"{what}: {directory} has no {stem}.safetensors")


def _load(path: Path, what: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise InteropError(f"{what}: {path} is not a readable safetensors file: {error}") from error


def _load_shards(directory: Path, index: dict[str, Any], what: str) -> dict[str, torch.Tensor]:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise InteropError(f"{what}: the safetensors index in {directory} has no weight_map")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        # A shard is a file in this directory: no paths, so an index cannot point elsewhere.
        if (
            not isinstance(shard, str)
            or Path(shard).name != shard
            or not shard.endswith(".safetensors")
        ):
            raise InteropError(f"{what}: index entry {shard!r} is not a .safetensors file name")
        tensors.update(_load(directory / shard, what))
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise InteropError(f"{what}: tensors listed in the index but in no shard: {missing}")
    return {name: tensors[name] for name in weight_map}


def check_destination(out: Path, overwrite: bool, sources: list[Path]) -> None:
    """``out`` may be written: it does not exist (or ``overwrite``) and is none of ``sources``."""
    for source in sources:
        if out.resolve() == source.resolve():
            raise InteropError(f"the output {out} is the input {source}; write somewhere else")
    if out.exists() and not overwrite:
        raise InteropError(f"{out} exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise InteropError(f"{out} exists and is not a directory")


def write_checkpoint(
    out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], weights_file: str
) -> Path:
    """``config.json`` + ``weights_file`` as one directory, renamed into place: complete or
    absent, never a mix."""
    staging = staging_dir_for(out)
    try:
        # "format": "pt" is what transformers' loaders expect in a safetensors header.
        save_file(tensors, str(staging / weights_file), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
