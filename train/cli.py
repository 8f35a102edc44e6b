"""``selfspec distill`` and ``selfspec train``: CLIs generated from typed signatures.

``distill`` takes the fields of `DistillConfig` as flags (``--target.model``, ``--max_new_tokens``)
or from a YAML file (``--config``). ``train`` is a LightningCLI over `HeadsModule` and
`DistilledDataModule`; a recipe YAML holds its values (see ``train/recipes``).
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import fields

from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

set_parsing_settings(docstring_parse_attribute_docstrings=True)


def _config_from_args(prog: str, description: str | None, config_class, argv):
    """Parse ``argv`` (flags or ``--config FILE.yaml``) into an instance of the frozen
    dataclass ``config_class``; logging configured."""
    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file of the flags below")
    parser.add_class_arguments(config_class, None, as_group=False)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    values = parser.instantiate(args)
    return config_class(**{f.name: values[f.name] for f in fields(config_class)})


def distill_main(argv: list[str] | None = None) -> int:
    from selfspec.target import TargetLoadError
    from selfspec.train.distill import DistillConfig, distill
    from selfspec.train.memory import MemoryBudgetError
    from selfspec.train.prompts import PromptsError

    try:
        config = _config_from_args("selfspec distill", distill.__doc__, DistillConfig, argv)
        report = distill(config)
    except (PromptsError, TargetLoadError, MemoryBudgetError, ValueError) as error:
        print(f"selfspec distill: error: {error}", file=sys.stderr)
        return 2
    print(
        f"distilled {report.rows} prompts into {config.output}: {report.shards_done} shards "
        f"generated, {report.shards_skipped} already done, {report.bad_lines} bad lines skipped; "
        f"{report.generated_tokens} tokens in {report.seconds:.0f} s "
        f"({report.tokens_per_second:.1f} tokens/s)"
    )
    return 0


LIGHTNING_CKPT_VALUES = ("last", "best", "hpc", "registry")
"""What Lightning's `ckpt_path` takes besides a path ("registry:<name>" included)."""
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*::|://")


def check_ckpt_path(ckpt_path: str | None) -> str | None:
    """`ckpt_path` if it is a local checkpoint path or one of `LIGHTNING_CKPT_VALUES`.

    A URL (`http://...`, `s3://...`, any `scheme://` or fsspec chain `a::b`) is refused: Lightning
    would fetch it and unpickle it with `torch.load(weights_only=False)`, which runs any code the
    file holds. Download a checkpoint you trust first and pass its local path."""
    if ckpt_path is None:
        return None
    if not isinstance(ckpt_path, str) or not ckpt_path:
        raise ValueError(f"--ckpt_path must be a non-empty string, got {ckpt_path!r}")
    if _URL.search(ckpt_path):  # LIGHTNING_CKPT_VALUES never match
        raise ValueError(
            f"--ckpt_path {ckpt_path!r} is a URL; resuming only reads local checkpoints, since "
            "Lightning unpickles them (torch.load with weights_only=False) and a remote file could "
            "run code: download it, check it, and pass the local path"
        )
    return ckpt_path


def train_main(argv: list[str] | None = None) -> int:
    from selfspec.train.lightning_cli import run_train

    return run_train(argv)


def recalibrate_main(argv: list[str] | None = None) -> int:
    """``selfspec recalibrate``: heads fine-tuned for one adapter (selfspec.train.recalibrate)."""
    from selfspec.train.recalibrate import main

    return main(argv)


def datagen_main(argv: list[str] | None = None) -> int:
    """``selfspec datagen``: the data engine (selfspec.train.datagen.engine)."""
    from selfspec.target import TargetLoadError
    from selfspec.train.datagen.engine import DataEngine, EngineConfig
    from selfspec.train.shards import DistilledDataError

    try:
        config = _config_from_args("selfspec datagen", DataEngine.__doc__, EngineConfig, argv)
        reports = DataEngine(config).run()
    except (TargetLoadError, DistilledDataError, ValueError) as error:
        print(f"selfspec datagen: error: {error}", file=sys.stderr)
        return 2
    for stage, report in reports.items():
        print(
            f"{stage}: {report.shards_done} shards generated, {report.shards_skipped} already "
            f"done, {report.rows} rows, {report.tokens} tokens in {report.seconds:.0f} s"
        )
    print(f"dataset card: {config.output}/README.md")
    return 0


def corpus_main(argv: list[str] | None = None) -> int:
    """``selfspec corpus``: a draft corpus of responses (selfspec.train.draft_corpus)."""
    from selfspec.target import TargetLoadError
    from selfspec.train.draft_corpus import CorpusConfig, build_draft_corpus
    from selfspec.train.shards import DistilledDataError

    try:
        config = _config_from_args("selfspec corpus", CorpusConfig.__doc__, CorpusConfig, argv)
        path, corpus = build_draft_corpus(config)
    except (TargetLoadError, DistilledDataError, ValueError) as error:
        print(f"selfspec corpus: error: {error}", file=sys.stderr)
        return 2
    print(f"draft corpus: {corpus.size} response tokens -> {path}")
    return 0
