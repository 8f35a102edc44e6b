"""`python -m selfspec.train.draft_vocab`: give existing heads a draft vocabulary from data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from selfspec.fingerprint import fingerprint_of
from selfspec.heads import build_heads, heads_config_for, load_heads, save_heads
from selfspec.target import TargetSpec, load_target
from selfspec.train.draft_vocab import frequent_tokens, main, response_token_counts
from selfspec.train.shards import load_distilled


def test_frequent_tokens_are_ascending_with_their_coverage() -> None:
    counts = torch.tensor([5, 0, 3, 9, 1])
    ids, coverage = frequent_tokens(counts, 3)
    assert ids.tolist() == [0, 2, 3] and coverage == pytest.approx(17 / 18)


def test_rewrites_heads_to_draft_from_the_most_frequent_response_tokens(
    tiny_target: Path, distilled: Path, tmp_path: Path
) -> None:
    model = load_target(TargetSpec(model=str(tiny_target))).model
    heads = build_heads(heads_config_for(model, "eagle"))
    path = save_heads(heads, tmp_path / "heads", fingerprint_of(model), extra={"note": "kept"})
    (path / "metrics.json").write_text('{"tau": 1.5}')
    assert main([str(path), "--data", str(distilled), "--size", "6"]) == 0
    assert (path / "metrics.json").read_text() == '{"tau": 1.5}'  # files beside it are kept
    loaded = load_heads(path, model)
    counts = response_token_counts(load_distilled(distilled), model.config.vocab_size)
    assert loaded.draft_vocab.tolist() == frequent_tokens(counts, 6)[0].tolist()
    # The weights are unchanged: only the vocabulary was added.
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)


def test_bad_size_and_missing_data_are_clear_errors(
    tiny_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = load_target(TargetSpec(model=str(tiny_target))).model
    path = save_heads(
        build_heads(heads_config_for(model, "medusa")), tmp_path / "h", fingerprint_of(model)
    )
    assert main([str(path), "--data", str(tmp_path), "--size", "0"]) == 2
    assert "--size must be in" in capsys.readouterr().err
    assert main([str(path), "--data", str(tmp_path / "none"), "--size", "5"]) == 2
    assert "not a directory" in capsys.readouterr().err
