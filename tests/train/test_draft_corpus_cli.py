"""`selfspec corpus`: a draft corpus from distilled responses, used by `selfspec generate`."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoModelForCausalLM

from selfspec import build_heads, heads_config_for, save_heads
from selfspec.cli import main
from selfspec.drafting.corpus import load_corpus
from selfspec.fingerprint import fingerprint_of
from selfspec.train.shards import load_distilled


def test_corpus_holds_the_responses_and_generate_reads_it(
    distilled: Path, tiny_target: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "corpus.safetensors"
    code = main(
        [
            "corpus",
            "--data",
            f"[{distilled}]",
            "--output",
            str(out),
            "--target.model",
            str(tiny_target),
        ]
    )
    assert code == 0, capsys.readouterr().err
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    corpus = load_corpus(out, fingerprint_of(model))
    rows = load_distilled(distilled)
    responses = sum(
        len(ids) - p for ids, p in zip(rows["input_ids"], rows["prompt_len"], strict=True)
    )
    assert corpus.size == responses
    heads = save_heads(
        build_heads(heads_config_for(model, "eagle")), tmp_path / "heads", fingerprint_of(model)
    )
    common = ["generate", "--no-chat", "--json", "--max-new-tokens", "8", "--prompt", "hello"]
    common += ["--model", str(tiny_target), "--heads", str(heads), "--tree", "dynamic:2,3,6"]
    capsys.readouterr()
    assert main([*common, "--draft-corpus", str(out)]) == 0
    with_corpus = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*common, "--draft-corpus", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == with_corpus
    assert main([*common, "--draft-corpus", str(tmp_path / "missing.safetensors")]) == 2
    assert "no draft corpus at" in capsys.readouterr().err
