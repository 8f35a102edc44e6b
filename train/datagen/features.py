"""The target's tapped states, saved as a by-product of generation, outside the dataset.

Features are large (SmolLM2-135M, three layers: 3.4 KB per token in float16, ~10 GB for 3M
tokens) and can always be recomputed by running the target over the token ids, so they live in
a local cache, one safetensors file per response shard, never beside the ids that go into git:

```
$SELFSPEC_CACHE/datagen-features/<run>-<hash of the run's path>/<stage>/shard-00000.safetensors
```

A file holds one tensor per row (named by its conversation index, # [n - 1, (k + 1) * H]
float16: the states entering the k ``layers``, then the last hidden state, the teacher's logits'
input) and, in its metadata, the shard's key and the layers: a file whose key or layers differ
from what is asked (the shard was regenerated, other heads) is ignored, as a missing one is.
Written atomically.

Training joins them to the rows (``load_stage``): each row gets the file holding its states, and
``DistilledDataModule`` reads them per batch (``row_states``), so a run over millions of tokens
never holds them all in memory and never runs the target.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from selfspec.atomic import write_file_atomic
from selfspec.paths import cache_root

logger = logging.getLogger(__name__)


class FeatureCache:
    def __init__(self, root: Path, layers: tuple[int, ...]) -> None:
        self.root, self.layers = root, tuple(layers)

    @classmethod
    def for_run(cls, output: Path, features_dir: str | None, layers) -> FeatureCache:
        if features_dir is not None:
            return cls(Path(features_dir), layers)
        digest = hashlib.sha256(str(Path(output).resolve()).encode()).hexdigest()[:10]
        return cls(cache_root() / "datagen-features" / f"{Path(output).name}-{digest}", layers)

    def path(self, stage: str, shard: str) -> Path:
        return self.root / stage / f"{shard}.safetensors"

    def write(self, stage: str, shard: str, key: str, rows: dict[str, np.ndarray]) -> Path:
        """rows: conversation index -> # [n - 1, (k + 1) * H] float16."""
        tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in rows.items()}
        metadata = {"key": key, "layers": json.dumps(list(self.layers))}
        path = self.path(stage, shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_file_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))

    def read(self, stage: str, shard: str, key: str) -> dict[str, torch.Tensor] | None:
        """The shard's rows, or None when the file is missing, unreadable or of another key."""
        path = self.path(stage, shard)
        if not path.is_file():
            return None
        try:
            if not self.holds(path, key):
                return None
            return load_file(str(path))
        except (SafetensorError, OSError):
            return None

    def holds(self, path: Path, key: str) -> bool:
        """Whether ``path`` is a readable feature file of shard key ``key`` and these layers."""
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
        except (SafetensorError, OSError):
            return False
        return meta.get("key") == key and meta.get("layers") == json.dumps(list(self.layers))


def load_stage(path: str | Path):
    """A data-engine stage directory (``OUT/responses``, ``OUT/followups``) as one dataset, with
    ``features_file`` (the cached states of each row, "" for none) and ``layer_ids`` columns
    when every shard's features are in the cache; without them otherwise (a warning says so:
    training then runs the target)."""
    from datasets import concatenate_datasets, load_from_disk

    from selfspec.train.shards import DistilledDataError, finished_key, load_distilled

    path = Path(path)
    record_path = path.parent / "engine.json"
    try:
        record = json.loads(record_path.read_text())
        cache = FeatureCache(Path(record["features_dir"]), tuple(record["tap_layers"]))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise DistilledDataError(f"{record_path} is missing or malformed: {error}") from error
    shards = sorted(p for p in path.glob("shard-*") if finished_key(p) is not None)
    files = [cache.path(path.name, shard.name) for shard in shards]
    if not shards or not all(
        cache.holds(file, finished_key(shard)) for file, shard in zip(files, shards, strict=True)
    ):
        if cache.layers:
            logger.warning(
                "%s: features not all cached under %s; training runs the target", path, cache.root
            )
        return load_distilled(path)
    parts = []
    for shard, file in zip(shards, files, strict=True):
        part = load_from_disk(str(shard))
        parts.append(
            part.add_column("features_file", [str(file)] * len(part)).add_column(
                "layer_ids", [list(cache.layers)] * len(part)
            )
        )
    return concatenate_datasets(parts)


def row_states(row: dict) -> dict:
    """``row`` with ``layer_features`` # [n - 1, k * H] and ``features`` # [n - 1, H] read from
    its ``features_file``."""
    with safe_open(str(row["features_file"]), framework="np") as handle:
        states = handle.get_slice(str(int(row["source_index"])))[:]
    hidden = states.shape[-1] // (len(row["layer_ids"]) + 1)
    return {**row, "layer_features": states[:, :-hidden], "features": states[:, -hidden:]}
