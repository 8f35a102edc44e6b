"""The target's tapped states, saved as a by-product of generation, outside the dataset.

Features are large (SmolLM2-135M, three layers: 3.4 KB per token in float16, ~10 GB for 3M
tokens) and can always be recomputed by running the target over the token ids, so they live in
a local cache, one safetensors file per response shard, never beside the ids that go into git:

```
$SELFSPEC_CACHE/datagen-features/<run>-<hash of the run's path>/<stage>/shard-00000.safetensors
```

A file holds one tensor per row (named by its conversation index, # [n - 1, k * H] float16)
and, in its metadata, the shard's key and the tapped layers: a file whose key differs from the
shard's (the shard was regenerated) is ignored, as a missing one is. Written atomically.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from selfspec.atomic import write_file_atomic
from selfspec.paths import cache_root


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
            with safe_open(str(path), framework="pt") as handle:
                if (handle.metadata() or {}).get("key") != key:
                    return None
            return load_file(str(path))
        except (SafetensorError, OSError):
            return None
