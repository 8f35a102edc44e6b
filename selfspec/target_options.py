"""The target options every CLI that loads a target shares: one declaration, so `selfspec
generate` and `selfspec serve` take the same flags as new modes and devices arrive.

A frozen, keyword-only dataclass: a CLI's own dataclass inherits it (its flags come first in
`--help`) and calls ``super().__post_init__()``. No torch import here (`selfspec --help` stays
fast); ``target_spec`` imports `selfspec.target` when a target is actually loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from selfspec.modes import (
    ACTIVATIONS_HELP,
    DEVICE_HELP,
    DTYPE_HELP,
    KERNELS_HELP,
    check_activations,
    check_device,
    check_dtype,
    cpu_only_reason,
)

if TYPE_CHECKING:
    from selfspec.target import TargetSpec


@dataclass(frozen=True, kw_only=True)
class TargetOptions:
    model: str | None = field(
        default=None,
        metadata={"help": "local HF model dir or .gguf file; omit for the embedded SmolLM2"},
    )
    dtype: str = field(default="float32", metadata={"help": DTYPE_HELP})
    activations: str = field(default="auto", metadata={"help": ACTIVATIONS_HELP})
    kernels: bool | None = field(default=None, metadata={"help": KERNELS_HELP})
    device: str = field(default="cpu", metadata={"help": DEVICE_HELP})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads"})

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        check_activations(self.activations, self.dtype, self.kernels)
        check_device(self.device)
        cpu_only = cpu_only_reason(self.dtype, self.kernels, activations=self.activations)
        if cpu_only is not None and self.device.startswith("cuda"):
            raise ValueError(
                f"--device {self.device} does not run {cpu_only}; on a GPU use --dtype float32 "
                "or bfloat16 (with --kernels left out or --no-kernels), or --device cpu"
            )

    @property
    def is_default_target(self) -> bool:
        """The embedded SmolLM2 (whose shipped heads and adapters the CLIs offer by name)."""
        return self.model in (None, "default")

    def target_spec(self) -> TargetSpec:
        from selfspec.target import TargetSpec

        return TargetSpec(
            model=self.model,
            dtype=self.dtype,
            activations=self.activations,
            kernels=self.kernels,
            threads=self.threads,
            device=self.device,
        )
