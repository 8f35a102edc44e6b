"""`selfspec distill`: dataset on disk, resumption by shard, bad prompt lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_helpers import PROMPTS, write_prompts

from selfspec.target import TargetSpec, load_target
from selfspec.train.cli import distill_main
from selfspec.train.distill import DistillConfig, distill
from selfspec.train.memory import MemoryBudgetError
from selfspec.train.prompts import OnBadLine, PromptsError, read_prompts
from selfspec.train.shards import DistilledDataError, finished_key, load_distilled, shard_dir


def test_distilled_rows_are_the_targets_greedy_answers(distilled: Path, tiny_target: Path) -> None:
    data = load_distilled(distilled)
    assert len(data) == len(PROMPTS)
    loaded = load_target(TargetSpec(model=str(tiny_target)))
    row = data[0]
    ids = torch.tensor(row["input_ids"])[None]  # [1, L]
    assert row["response_len"] == ids.shape[1] - row["prompt_len"] > 0
    with torch.no_grad():
        features = loaded.model.get_decoder()(ids[:, :-1]).last_hidden_state[0]  # [L-1, H]
        greedy = loaded.model.lm_head(features).argmax(-1)  # [L-1]
    stored = torch.tensor(row["features"])  # [L-1, H] float16
    assert stored.shape == features.shape
    torch.testing.assert_close(stored.float(), features, atol=2e-2, rtol=1e-2)
    # Greedy: every response token is the target's argmax after its prefix.
    assert greedy[row["prompt_len"] - 1 :].tolist() == row["input_ids"][row["prompt_len"] :]


def test_resume_skips_finished_shards(tiny_target: Path, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "all.jsonl", PROMPTS[:20])
    subset = write_prompts(tmp_path / "subset.jsonl", PROMPTS[:12])
    out = tmp_path / "data"
    loaded = load_target(TargetSpec(model=str(tiny_target)))

    def run(source: Path):
        config = DistillConfig(
            prompts=str(source), output=str(out), max_new_tokens=6, batch_size=4, shard_size=8
        )
        return distill(config, loaded)

    first = run(subset)  # an interrupted run: shard 0 full, shard 1 partial
    assert (first.shards_done, first.shards_skipped) == (2, 0)
    kept = (shard_dir(out, 0) / "data-00000-of-00001.arrow").stat().st_mtime_ns
    second = run(prompts)
    assert (second.shards_done, second.shards_skipped) == (2, 1)  # shard 1 had other prompts
    assert (shard_dir(out, 0) / "data-00000-of-00001.arrow").stat().st_mtime_ns == kept
    assert run(prompts).shards_done == 0
    assert len(load_distilled(out)) == 20
    assert all(finished_key(shard_dir(out, i)) for i in range(3))


def test_sampling_is_seeded_per_shard(tiny_target: Path, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:4])
    loaded = load_target(TargetSpec(model=str(tiny_target)))
    rows = []
    for name in ("a", "b"):
        config = DistillConfig(
            prompts=str(prompts),
            output=str(tmp_path / name),
            do_sample=True,
            max_new_tokens=8,
            batch_size=2,
            seed=3,
        )
        distill(config, loaded)
        rows.append(load_distilled(tmp_path / name)["input_ids"])
    assert rows[0] == rows[1]


def test_bad_lines_are_reported_with_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\nnot json\n{"prompt": ""}\n\n[1, 2]\n{"prompt": "ok"}\n')
    records, bad = read_prompts(path, OnBadLine.skip)
    assert [r.source_index for r in records] == [1, 6]
    assert [b.line for b in bad] == [2, 3, 5]
    with pytest.raises(PromptsError, match=r"p\.jsonl:2:"):
        read_prompts(path, OnBadLine.fail)


def test_cli_reports_bad_lines_and_fails_by_default(
    tiny_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n{"text": "wrong key"}\n')
    args = [
        "--prompts",
        str(path),
        "--output",
        str(tmp_path / "out"),
        "--target.model",
        str(tiny_target),
        "--max_new_tokens",
        "4",
    ]
    assert distill_main(args) == 2
    assert "p.jsonl:2:" in capsys.readouterr().err
    assert distill_main([*args, "--on_bad_line", "skip"]) == 0
    assert "1 bad lines skipped" in capsys.readouterr().out
    assert len(load_distilled(tmp_path / "out")) == 1


def test_messages_prompts_and_datasets_sources(tmp_path: Path) -> None:
    from datasets import Dataset

    Dataset.from_dict({"prompt": ["a", "b"]}).save_to_disk(str(tmp_path / "ds"))
    records, _ = read_prompts(tmp_path / "ds")
    assert [r.prompt for r in records] == ["a", "b"]
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert read_prompts(path)[0][0].prompt == [{"role": "user", "content": "hi"}]
    Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "wrong"))
    with pytest.raises(PromptsError, match="needs a 'prompt' or 'messages' column"):
        read_prompts(tmp_path / "wrong")


def test_empty_inputs_are_clear_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PromptsError, match="empty.jsonl holds no usable prompt"):
        read_prompts(empty)
    with pytest.raises(PromptsError, match="neither a JSONL file"):
        read_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "nodata").mkdir()
    with pytest.raises(DistilledDataError, match="nodata has no finished shard"):
        load_distilled(tmp_path / "nodata")


def test_oversized_settings_are_caught_before_generating(tiny_target: Path, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    config = DistillConfig(
        prompts=str(prompts),
        output=str(tmp_path / "out"),
        target=TargetSpec(model=str(tiny_target)),
        batch_size=10**9,
    )
    with pytest.raises(MemoryBudgetError, match="batch_size=1000000000"):
        distill(config)
    assert not (tmp_path / "out").exists()


def test_tapped_layers_are_the_targets_states_entering_them(
    tiny_target: Path, tmp_path: Path
) -> None:
    """``tap_layers``: each row keeps the states entering those layers at every position, as a
    teacher-forced forward shows them (HF's ``hidden_states[k]``), left padding notwithstanding."""
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:6])
    loaded = load_target(TargetSpec(model=str(tiny_target)))
    layers = (1, 2)
    config = DistillConfig(
        prompts=str(prompts), output=str(tmp_path / "data"), max_new_tokens=10, batch_size=6,
        tap_layers=layers,
    )  # fmt: skip
    distill(config, loaded)
    data = load_distilled(tmp_path / "data")
    assert len({row["prompt_len"] for row in data}) > 1  # rows were padded differently
    for row in data:
        assert row["layer_ids"] == list(layers)
        ids = torch.tensor(row["input_ids"])[None, :-1]  # [1, L-1]
        with torch.no_grad():
            states = loaded.model(ids, output_hidden_states=True).hidden_states
        expected = torch.cat([states[k][0] for k in layers], dim=-1)  # [L-1, 2H]
        stored = torch.tensor(row["layer_features"]).float()  # [L-1, 2H]
        torch.testing.assert_close(stored, expected, atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="tap_layers needs store_features"):
        DistillConfig(prompts="p", output="o", store_features=False, tap_layers=layers)
