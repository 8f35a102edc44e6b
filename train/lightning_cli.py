"""``selfspec train``: a LightningCLI over `HeadsModule` + `DistilledDataModule`, then export.

Every option comes from a typed signature; a recipe YAML (``--config train/recipes/...``) only
stores values, and any flag overrides it (``--trainer.max_steps 50``). Strategies (DDP, FSDP) are
configuration: ``--trainer.strategy ddp --trainer.devices 2``. ``--ckpt_path last`` resumes a
killed run from its last Lightning checkpoint (heads and optimizer state only).
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

from selfspec.target import TargetLoadError
from selfspec.train.cli import check_ckpt_path
from selfspec.train.datamodule import DistilledDataModule
from selfspec.train.export import ExportHeads
from selfspec.train.memory import MemoryBudgetError
from selfspec.train.module import HeadsModule
from selfspec.train.shards import DistilledDataError


class TrainCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--ckpt_path",
            type=str | None,
            default=None,
            help='Lightning checkpoint to resume from; "last" takes the newest of ModelCheckpoint',
        )
        parser.add_lightning_class_args(ExportHeads, "export")

    def before_instantiate_classes(self) -> None:
        # Before anything is built or fetched: Lightning would unpickle a remote checkpoint.
        check_ckpt_path(self.config.get("ckpt_path"))


def run_train(argv: list[str] | None = None) -> int:
    try:
        cli = TrainCLI(
            HeadsModule,
            DistilledDataModule,
            run=False,
            args=argv,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            parser_kwargs={"prog": "selfspec train"},
        )
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.ckpt_path)
    except (TargetLoadError, DistilledDataError, MemoryBudgetError, ValueError) as error:
        print(f"selfspec train: error: {error}", file=sys.stderr)
        return 2
    return 0
