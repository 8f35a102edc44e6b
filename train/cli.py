"""``selfspec distill`` and ``selfspec train``: CLIs generated from typed signatures.

``distill`` takes the fields of `DistillConfig` as flags (``--target.model``, ``--max_new_tokens``)
or from a YAML file (``--config``). ``train`` is a LightningCLI over `HeadsModule` and
`DistilledDataModule`; a recipe YAML holds its values (see ``train/recipes``).
"""

from __future__ import annotations

import logging
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
