"""The record of a data-engine run: ``OUT/engine.json`` and the dataset card ``OUT/README.md``.

Per stage, the rows, generated tokens and seconds are summed over its finished shards' own
records (``shard.json``), so the totals hold across any number of resumed runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from selfspec.atomic import write_text_atomic
from selfspec.train.shards import SHARD_META, finished_key, write_json

STAGE_DIRS = ("prompts", "responses", "followups")


def stage_totals(out: Path) -> dict[str, dict[str, Any]]:
    totals = {}
    for stage in STAGE_DIRS:
        metas = [
            json.loads((p / SHARD_META).read_text())
            for p in sorted((out / stage).glob("shard-*"))
            if finished_key(p) is not None
        ]
        totals[stage] = {
            "shards": len(metas),
            "rows": sum(m["rows"] for m in metas),
            "generated_tokens": sum(m["generated_tokens"] for m in metas),
            "seconds": round(sum(m["seconds"] for m in metas), 1),
        }
    return totals


def write_record(out: Path, record: dict[str, Any], planned: int) -> None:
    """``record`` (settings, machine) completed with the stage totals and the dedup counts."""
    dedup_path = out / "dedup.json"
    dedup = json.loads(dedup_path.read_text()) if dedup_path.is_file() else None
    record = {
        **record,
        "stages": stage_totals(out),
        "dedup": None if dedup is None else {k: v for k, v in dedup.items() if k != "kept"},
    }
    write_json(out / "engine.json", record)
    write_text_atomic(out / "README.md", card(record, planned))


def card(record: dict[str, Any], planned: int) -> str:
    lines = [
        "# Dataset card: selfspec data engine run",
        "",
        f"Target: {record['settings']['target']} ({record['settings']['dtype']}), "
        f"CPU flags: {' '.join(record['cpu_flags']) or 'unknown'}, batch {record['batch_size']}.",
        f"Planned conversations: {planned}; features tapped at layers {record['tap_layers']} "
        "and the last hidden state (kept in a local cache, not here).",
        "",
        "| stage | shards | rows | generated tokens | seconds | tokens/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in record["stages"].items():
        rate = s["generated_tokens"] / s["seconds"] if s["seconds"] else 0.0
        lines.append(
            f"| {name} | {s['shards']} | {s['rows']} | {s['generated_tokens']} | {s['seconds']} "
            f"| {rate:.0f} |"
        )
    answered = record.get("answered_by")
    if answered:
        lines += ["", "| responses answered by | rows |", "|---|---:|"]
        lines += [f"| {name} | {rows} |" for name, rows in answered.items()]
    dedup = record.get("dedup")
    if dedup:
        lines += ["", "| category | usable user turns | kept after dedup |", "|---|---:|---:|"]
        for name in sorted(dedup["written"]):
            kept = dedup["after_dedup"].get(name, 0)
            lines.append(f"| {name} | {dedup['written'][name]} | {kept} |")
    return "\n".join(lines) + "\n"
