"""`selfspec train --ckpt_path`: local checkpoints and Lightning's special values only, no URL."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from selfspec.train.cli import LIGHTNING_CKPT_VALUES, check_ckpt_path


@pytest.mark.parametrize(
    "ckpt_path",
    [
        None,
        *LIGHTNING_CKPT_VALUES,
        "registry:heads-model:v2",
        "runs/eagle/checkpoints/last.ckpt",
        "/abs/path/epoch=1-step=50.ckpt",
        "C:\\runs\\last.ckpt",
    ],
)
def test_local_paths_and_special_values_are_kept(ckpt_path) -> None:
    assert check_ckpt_path(ckpt_path) == ckpt_path


@pytest.mark.parametrize(
    "ckpt_path",
    [
        "http://example.com/last.ckpt",
        "https://example.com/last.ckpt",
        "s3://bucket/last.ckpt",
        "file:///tmp/last.ckpt",
        "HTTP://EXAMPLE.COM/x.ckpt",
        "simplecache::https://example.com/x.ckpt",
        "memory::x.ckpt",
    ],
)
def test_urls_are_refused_with_a_clear_error(ckpt_path) -> None:
    with pytest.raises(ValueError, match=r"--ckpt_path .* is a URL; .*weights_only=False"):
        check_ckpt_path(ckpt_path)


def test_the_train_cli_checks_before_building_anything() -> None:
    from selfspec.train.lightning_cli import TrainCLI

    fake = SimpleNamespace(config={"ckpt_path": "https://example.com/last.ckpt"})
    with pytest.raises(ValueError, match="is a URL"):
        TrainCLI.before_instantiate_classes(fake)
    TrainCLI.before_instantiate_classes(SimpleNamespace(config={"ckpt_path": "last"}))
