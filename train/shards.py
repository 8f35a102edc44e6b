"""The distilled dataset on disk: one `datasets` directory per shard, written atomically.

```
OUT/shard-00000/       datasets `save_to_disk` + shard.json (its key, rows, tokens, seconds)
OUT/shard-00001/ ...
OUT/distill.json       settings and totals of the last complete run
```

A shard's key hashes the generation settings and the prompts it holds, so a restarted run skips
exactly the shards that are already done with the same prompts and settings, and regenerates
any other. Readers take every finished shard, so training can start on a run still in progress.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from selfspec.atomic import replace_dir, staging_dir_for, write_text_atomic

SHARD_META = "shard.json"
MANIFEST = "distill.json"
COLUMNS = ("input_ids", "prompt_len")


class DistilledDataError(ValueError):
    """A distilled dataset that is missing, empty or malformed; the message names it."""


def shard_dir(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}"


def shard_key(settings: dict[str, Any], prompts: list[Any]) -> str:
    blob = json.dumps({"settings": settings, "prompts": prompts}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def finished_key(path: Path) -> str | None:
    """The key of a finished shard, or None when ``path`` is not one."""
    try:
        return json.loads((path / SHARD_META).read_text())["key"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None


def empty_shard(path: Path) -> bool:
    """Whether a finished shard recorded 0 rows (a data-engine shard whose every follow-up turn
    was dropped): nothing to read, and ``datasets`` cannot load a 0-row directory back."""
    try:
        return json.loads((path / SHARD_META).read_text()).get("rows") == 0
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def write_shard(
    path: Path,
    columns: dict[str, Any],
    meta: dict[str, Any],
    features=None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save rows as a `datasets` directory at ``path``: staged, then renamed into place.
    ``extra``: the `datasets` types of columns beyond the distilled ones."""
    from datasets import Array2D, Value
    from datasets import Sequence as Seq

    schema = {
        "input_ids": Seq(Value("int32")),
        "prompt_len": Value("int32"),
        "response_len": Value("int32"),
        "finished": Value("bool"),
        "source_index": Value("int64"),
    }
    if "features" in columns:
        schema["features"] = Array2D(shape=(None, features), dtype="float16")
    write_rows(path, columns, meta, {**schema, **(extra or {})})


def write_rows(path: Path, columns: dict[str, Any], meta: dict[str, Any], schema) -> None:
    """Any rows (``schema``: column name -> `datasets` type) as a shard directory at ``path``,
    complete or absent: staged beside it, then renamed into place."""
    from datasets import Dataset, Features

    data = Dataset.from_dict(columns, features=Features(schema))
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir_for(path)
    try:
        data.save_to_disk(str(staging / "data"))
        for item in (staging / "data").iterdir():
            item.rename(staging / item.name)
        (staging / "data").rmdir()
        (staging / SHARD_META).write_text(json.dumps(meta, indent=2) + "\n")
        replace_dir(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic JSON write (temp file beside ``path``, then rename)."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def load_distilled(path: str | Path):
    """Every finished shard under ``path`` as one `datasets.Dataset`, checked for its columns."""
    from datasets import concatenate_datasets, load_from_disk

    path = Path(path)
    if not path.is_dir():
        raise DistilledDataError(f"distilled dataset {path} is not a directory")
    shards = sorted(p for p in path.glob("shard-*") if finished_key(p) is not None)
    if not shards:
        raise DistilledDataError(
            f"distilled dataset {path} has no finished shard (shard-*/{SHARD_META}); "
            "create one with `selfspec distill`"
        )
    parts = []
    for shard in shards:
        if empty_shard(shard):
            continue
        try:
            part = load_from_disk(str(shard))
        except (FileNotFoundError, ValueError) as error:
            raise DistilledDataError(f"shard {shard} is not a readable dataset: {error}") from error
        missing = [c for c in COLUMNS if c not in part.column_names]
        if missing:
            raise DistilledDataError(
                f"shard {shard} lacks the columns {missing}; expected at least {list(COLUMNS)}"
            )
        parts.append(part)
    data = concatenate_datasets(parts)
    if len(data) == 0:
        raise DistilledDataError(f"distilled dataset {path} has no rows")
    return data
