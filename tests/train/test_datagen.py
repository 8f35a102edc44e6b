"""The data engine (selfspec datagen): plan, dedup, stages, resumption, corrupt shards, features."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from selfspec.target import TargetSpec
from selfspec.train.cli import datagen_main
from selfspec.train.datagen import engine as engine_module
from selfspec.train.datagen.categories import CATEGORIES, LANGUAGE_PAIRS
from selfspec.train.datagen.dedup import DedupConfig, near_duplicates
from selfspec.train.datagen.engine import DataEngine, EngineConfig
from selfspec.train.datagen.passages import _roff_section
from selfspec.train.datagen.plan import PlanConfig, plan
from selfspec.train.shards import DistilledDataError, finished_key, load_distilled, write_shard

PASSAGES = [f"Passage {i} tells about rivers, hills and the town of Number{i}." for i in range(8)]


@pytest.fixture(autouse=True)
def fixed_passages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine plans over these instead of reading the machine's installed text."""
    monkeypatch.setattr(engine_module, "installed_passages", lambda: list(PASSAGES))


def _config(target: Path, out: Path, **overrides) -> EngineConfig:
    base = EngineConfig(
        output=str(out),
        target=TargetSpec(model=str(target), threads=1),
        bf16="off",
        plan=PlanConfig(conversations=24, follow_up_share=0.5),
        batch_size=4,
        shard_size=4,
        round_size=12,
        max_user_tokens=12,
        max_new_tokens=10,
        max_prompt_tokens=160,
        features_dir=str(out.parent / f"{out.name}-features"),
    )
    return replace(base, **overrides)


def test_the_categories_cover_what_the_issue_asks() -> None:
    names = {c.name for c in CATEGORIES}
    assert {
        "chat",
        "writing",
        "roleplay",
        "reasoning",
        "coding",
        "math",
        "translation",
        "summarization",
        "qa",
        "rag",
    } <= names
    assert len(set(LANGUAGE_PAIRS)) >= 6
    assert all(c.passage for c in CATEGORIES if c.name in ("summarization", "rag"))


def test_the_plan_is_deterministic_and_grows_without_changing_its_prefix() -> None:
    small = plan(PlanConfig(conversations=50, seed=3), PASSAGES)
    large = plan(PlanConfig(conversations=200, seed=3), PASSAGES)
    assert small == large[:50]
    assert plan(PlanConfig(conversations=50, seed=4), PASSAGES) != small
    assert len({c.category for c in large}) >= 8
    greedy = sum(c.temperature == 0 for c in large) / len(large)
    assert 0.25 < greedy < 0.55  # greedy_share 0.4
    passages = [c for c in large if c.category in ("summarization", "rag")]
    assert passages and all(any(p in c.opener for p in PASSAGES) for c in passages)
    only = plan(PlanConfig(conversations=20, categories=("math",)), [])
    assert {c.category for c in only} == {"math"}
    with pytest.raises(ValueError, match="unknown categories"):
        PlanConfig(categories=("poetry",))
    with pytest.raises(ValueError, match="no passages"):
        plan(PlanConfig(conversations=5, categories=("rag",)), [])


def test_dedup_drops_near_copies_keeps_the_first_and_is_prefix_stable() -> None:
    texts = [
        "Write a short story about the ocean and a lost boat far out at sea",
        "How do I sort a list of numbers in Python by their absolute value",
        "Write a short story about the ocean and a lost boat far out at sea!",
        "What is the capital of France and why is it famous",
        "write a short story about the ocean and a lost boat far out at sea",
    ]
    assert near_duplicates(texts) == [2, 4]
    for end in range(1, len(texts) + 1):
        assert near_duplicates(texts[:end]) == [i for i in [2, 4] if i < end]
    assert near_duplicates(texts, DedupConfig(threshold=1.0)) == [2, 4]
    with pytest.raises(ValueError, match="multiple of bands"):
        DedupConfig(permutations=10, bands=4)


def test_roff_descriptions_become_plain_text() -> None:
    page = (
        ".TH LS 1\n.SH NAME\nls \\- list\n.SH DESCRIPTION\n.PP\nList information about the "
        "\\fBFILEs\\fR.\n.PP\nSort entries.\n.SH OPTIONS\n-a\n"
    )
    text = _roff_section(page, "DESCRIPTION")
    assert "List information about the FILEs." in text and "Sort entries." in text
    assert "OPTIONS" not in text and "\\f" not in text


def test_a_run_writes_every_stage_resumes_and_names_a_corrupt_shard(
    chatty_target: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    config = _config(chatty_target, out)
    reports = DataEngine(config).run()
    assert reports["prompts"].shards_done == 6 and reports["responses"].rows > 0
    record = json.loads((out / "engine.json").read_text())
    assert set(record["stages"]) == {"prompts", "responses", "followups"}
    assert record["stages"]["responses"]["seconds"] > 0
    assert record["dedup"]["written"] and "kept" not in record["dedup"]
    card = (out / "README.md").read_text()
    assert "| responses |" in card and "kept after dedup" in card

    rows = load_distilled(out / "responses")
    assert set(rows.column_names) >= {"input_ids", "prompt_len", "category", "temperature", "turn"}
    assert all(
        0 < p < len(ids) for ids, p in zip(rows["input_ids"], rows["prompt_len"], strict=True)
    )
    features = sorted((tmp_path / "run-features" / "responses").glob("*.safetensors"))
    assert features, "the tapped states of the responses are written to the feature cache"
    from safetensors.torch import load_file

    shard0 = load_distilled(out / "responses").filter(lambda r: r["source_index"] < 4)
    tensors = load_file(str(features[0]))
    for index, ids in zip(shard0["source_index"], shard0["input_ids"], strict=True):
        assert tensors[str(index)].shape == (len(ids) - 1, 4 * 32)  # 3 layers + last hidden

    # A rerun generates nothing; its shards are the same files.
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*.arrow")}
    again = DataEngine(config).run()
    assert all(r.shards_done == 0 for name, r in again.items() if name != "dedup")
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*.arrow")}

    # A corrupt shard is an error naming it.
    broken = out / "prompts" / "shard-00001"
    for arrow in broken.glob("*.arrow"):
        arrow.write_bytes(b"not arrow")
    with pytest.raises(DistilledDataError, match="shard-00001"):
        DataEngine(replace(config, stages=("dedup",))).run()


def test_a_killed_run_resumes_to_what_an_uninterrupted_run_writes(
    chatty_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = tmp_path / "whole"
    DataEngine(_config(chatty_target, whole)).run()

    killed = tmp_path / "killed"
    original = engine_module.write_shard
    calls = []

    def dying(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed while writing a response shard")
        return original(path, *args, **kwargs)

    monkeypatch.setattr(engine_module, "write_shard", dying)
    with pytest.raises(KeyboardInterrupt):
        DataEngine(_config(chatty_target, killed)).run()
    assert not list((killed / "responses").glob(".*")), "no staging directory is left behind"
    monkeypatch.setattr(engine_module, "write_shard", original)
    DataEngine(_config(chatty_target, killed)).run()

    for stage in ("prompts", "responses", "followups"):
        a, b = load_distilled_any(whole / stage), load_distilled_any(killed / stage)
        assert a == b, stage


def load_distilled_any(path: Path) -> list[dict]:
    from datasets import load_from_disk

    return [row for shard in sorted(path.glob("shard-*")) for row in load_from_disk(str(shard))]


def test_max_shards_runs_a_chunk_and_the_cli_finishes_it(
    chatty_target: Path, tmp_path: Path
) -> None:
    out = tmp_path / "chunks"
    config = _config(chatty_target, out, max_shards=2)
    DataEngine(config).run()
    assert len(list((out / "prompts").glob("shard-*"))) == 2
    assert not (out / "responses").exists()
    args = [
        "--output",
        str(out),
        "--target.model",
        str(chatty_target),
        "--target.threads",
        "1",
        "--bf16",
        "off",
        "--plan.conversations",
        "24",
        "--plan.follow_up_share",
        "0.5",
        "--batch_size",
        "4",
        "--shard_size",
        "4",
        "--round_size",
        "12",
        "--max_user_tokens",
        "12",
        "--max_new_tokens",
        "10",
        "--max_prompt_tokens",
        "160",
        "--features_dir",
        str(tmp_path / "chunks-features"),
    ]
    assert datagen_main(args) == 0
    assert len(list((out / "prompts").glob("shard-*"))) == 6
    uninterrupted = tmp_path / "one-go"
    DataEngine(_config(chatty_target, uninterrupted)).run()
    assert load_distilled_any(out / "responses") == load_distilled_any(uninterrupted / "responses")
    assert datagen_main([*args, "--round_size", "10"]) == 2  # not a multiple of shard_size
    shutil.rmtree(out)


def test_a_grown_plan_keeps_every_finished_shard(chatty_target: Path, tmp_path: Path) -> None:
    out = tmp_path / "grow"
    small = _config(chatty_target, out, plan=PlanConfig(conversations=12, follow_up_share=0.5))
    first = DataEngine(small).run()
    assert first["prompts"].shards_done == 3
    grown = DataEngine(_config(chatty_target, out)).run()  # 24 conversations
    # Only the new conversations' shards are generated (each round sees the old ones as done).
    assert grown["prompts"].shards_done == 3 and grown["prompts"].shards_skipped >= 3
    assert grown["responses"].shards_done <= 3
    lines = (out / "plan.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 24
    assert DataEngine(small)._plan() == DataEngine(_config(chatty_target, out))._plan()[:12]


def _adapter(target: Path, path: Path) -> None:
    """A LoRA adapter of ``target`` on the output projections (zero in the chatty target, so it
    moves the states), random non-zero weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = AutoModelForCausalLM.from_pretrained(target)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"])
        model = get_peft_model(model, config)
        for name, param in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=0.5)
    model.save_pretrained(path, safe_serialization=True)


def _features(root: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(root.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_adapters_answer_their_share_with_their_own_states(
    chatty_target: Path, tmp_path: Path
) -> None:
    import torch

    _adapter(chatty_target, tmp_path / "adapters" / "loud")
    plain = _config(chatty_target, tmp_path / "plain")
    mixed = replace(
        _config(chatty_target, tmp_path / "mixed"),
        adapters=("loud",),
        adapters_root=str(tmp_path / "adapters"),
        adapter_share=0.5,
    )
    DataEngine(plain).run()
    engine = DataEngine(mixed)
    engine.run()
    rows = load_distilled(tmp_path / "mixed" / "responses")
    by = dict(zip(rows["source_index"], rows["answerer"], strict=True))
    assert set(by.values()) == {"", "loud"}
    assert all(engine.answerer(i) == (name or None) for i, name in by.items())
    ours = _features(tmp_path / "mixed-features" / "responses")
    theirs = _features(tmp_path / "plain-features" / "responses")
    for index, name in by.items():  # the base's answers are the plain run's; the adapter's not
        same = torch.equal(ours[str(index)], theirs[str(index)])
        assert same == (name == ""), (index, name)
    # Second turns: the user's turn is always the base's (whoever answered just before), so a
    # base-answered conversation is the plain run's.
    follow = load_distilled(tmp_path / "mixed" / "followups")
    plain_follow = load_distilled(tmp_path / "plain" / "followups")
    plain_ids = dict(zip(plain_follow["source_index"], plain_follow["input_ids"], strict=True))
    based = [
        (i, ids)
        for i, ids, name in zip(
            follow["source_index"], follow["input_ids"], follow["answerer"], strict=True
        )
        if name == ""
    ]
    assert based and all(ids == plain_ids[i] for i, ids in based)
    card = (tmp_path / "mixed" / "README.md").read_text()
    assert "| loud |" in card and "| (base) |" in card
    # Both runs train together (their columns differ by the answerer).
    from selfspec.train.datamodule import DistilledDataModule

    both = DistilledDataModule(
        train_data=[str(tmp_path / "plain" / "responses"), str(tmp_path / "mixed" / "responses")],
        val_fraction=0.0,
        batch_size=2,
    )
    both.setup("fit")
    assert len(both.train_set) == 2 * len(rows)
    # Who answers does not change the user turns: the base run's prompts are reused as they are.
    for plain_shard in sorted((tmp_path / "plain" / "prompts").glob("shard-*")):
        mixed_shard = tmp_path / "mixed" / "prompts" / plain_shard.name
        assert finished_key(mixed_shard) == finished_key(plain_shard)
    again = DataEngine(mixed).run()  # resumes: nothing to generate
    assert all(r.shards_done == 0 for name, r in again.items() if name != "dedup")
    with pytest.raises(ValueError, match="nobody"):
        DataEngine(replace(mixed, adapters=("nobody",)))
    with pytest.raises(ValueError, match="adapters_root"):
        replace(mixed, adapters_root=None)


def test_a_shard_with_no_rows_is_skipped_when_read(chatty_target: Path, tmp_path: Path) -> None:
    """A follow-ups shard whose every second user turn was dropped has 0 rows: the data still
    loads (``datasets`` cannot read a 0-row directory back)."""
    out = tmp_path / "run"
    DataEngine(_config(chatty_target, out)).run()
    rows = len(load_distilled(out / "followups"))
    columns = {name: [] for name in load_distilled(out / "followups").column_names}
    from selfspec.train.datagen.engine import _response_extra

    write_shard(
        out / "followups" / "shard-00099",
        columns,
        {"key": "k", "rows": 0, "generated_tokens": 0, "seconds": 0.0},
        extra=_response_extra(),
    )
    assert len(load_distilled(out / "followups")) == rows
