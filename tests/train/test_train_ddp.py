"""DDP is configuration: 2 CPU processes (gloo) end a short fit with identical heads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
from safetensors.torch import load_file

from selfspec.target import TargetSpec
from selfspec.train.module import HeadsModule

SCRIPT = """
import sys
from pathlib import Path
import lightning as L
from safetensors.torch import save_file
from selfspec.target import TargetSpec
from selfspec.train.datamodule import DistilledDataModule
from selfspec.train.module import HeadsModule

target, data, out = sys.argv[1:4]
L.seed_everything(0)
module = HeadsModule(TargetSpec(model=target), kind="eagle")
trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=3, logger=False,
                    enable_progress_bar=False, enable_checkpointing=False,
                    num_sanity_val_steps=0, limit_val_batches=0)
trainer.fit(module, datamodule=DistilledDataModule(data, batch_size=2, val_fraction=0))
state = {k: v.contiguous() for k, v in module.heads.state_dict().items()}
save_file(state, str(Path(out) / f"rank{trainer.global_rank}.safetensors"))
"""


def test_ddp_ranks_end_with_identical_heads(
    tiny_target: Path, distilled: Path, tmp_path: Path
) -> None:
    script = tmp_path / "ddp_fit.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_DISABLE_FORK": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_target), str(distilled), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1)]
    initial = initial_heads(tiny_target)
    assert ranks[0].keys() == ranks[1].keys() == initial.keys()
    for name in ranks[0]:
        assert (ranks[0][name] == ranks[1][name]).all(), name
    assert any(not (ranks[0][n] == initial[n]).all() for n in initial), "the heads did not train"


def initial_heads(target: Path) -> dict:
    L.seed_everything(0)
    return HeadsModule(TargetSpec(model=str(target)), kind="eagle").heads.state_dict()
