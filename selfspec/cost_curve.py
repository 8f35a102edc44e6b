"""The verification cost curve: seconds of one target forward (body + lm_head) per tree size.

How the cost grows with the number of tree tokens depends on the machine, the dtype and the
thread count (on a CPU without native bf16 a 16-token forward can cost 2x a 1-token forward; with
AMX it costs barely more), so it is measured, not assumed: once per (model, dtype, threads,
torch, CPU) and cached as JSON beside the converted targets. The tree sizer reads it to choose
how many draft tokens a step should verify.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfspec.atomic import write_text_atomic
from selfspec.fingerprint import fingerprint_of
from selfspec.kernels import extension
from selfspec.kernels.modules import kernel_mode_of
from selfspec.kernels.ops import kernel_isa
from selfspec.packed_linear import is_packed
from selfspec.target_forward import TargetForward
from selfspec.tree import DynamicTree, TreeSpec

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
FORMAT = "selfspec-cost-curve"


@dataclass(frozen=True)
class CostCurve:
    """Measured forward seconds at a few tree sizes; linear in between and beyond."""

    sizes: tuple[int, ...]
    """Tree tokens per forward (root included), ascending, starting at 1."""
    seconds: tuple[float, ...]
    """Median seconds of one verification forward at each size."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        object.__setattr__(self, "seconds", tuple(float(s) for s in self.seconds))
        if len(self.sizes) < 2 or len(self.sizes) != len(self.seconds):
            raise ValueError("a cost curve needs >= 2 sizes and one time per size")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"cost curve sizes must be ascending and >= 1, got {self.sizes}")
        if any(not s > 0 for s in self.seconds):
            raise ValueError(f"cost curve seconds must be > 0, got {self.seconds}")
        # A later size never costs less than an earlier one (timing noise can say otherwise).
        running = list(self.seconds)
        for i in range(1, len(running)):
            running[i] = max(running[i], running[i - 1])
        object.__setattr__(self, "seconds", tuple(running))

    def at(self, size: int) -> float:
        """Seconds of a forward over ``size`` tree tokens. # scalar"""
        sizes, seconds = self.sizes, self.seconds
        i = bisect.bisect_left(sizes, size)
        if i < len(sizes) and sizes[i] == size:
            return seconds[i]
        lo, hi = (len(sizes) - 2, len(sizes) - 1) if i >= len(sizes) else (max(i - 1, 0), max(i, 1))
        slope = (seconds[hi] - seconds[lo]) / (sizes[hi] - sizes[lo])
        return max(seconds[lo] + slope * (size - sizes[lo]), seconds[0])

    def relative(self) -> dict[int, float]:
        """Cost of each measured size relative to a 1-token forward."""
        return {s: t / self.at(1) for s, t in zip(self.sizes, self.seconds, strict=True)}

    def to_dict(self) -> dict[str, object]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> CostCurve:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a cost curve (format != {FORMAT!r})")
        return cls(sizes=tuple(data["sizes"]), seconds=tuple(data["seconds"]))  # type: ignore[arg-type]


def elapsed_seconds(started: float, device: torch.device) -> float:
    """Seconds since ``started`` (``time.perf_counter``), once the device's queued work is done:
    the clock of every verification timing (this curve, and the loop's and server's steps)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure_cost_curve(
    target: TargetForward,
    sizes: Sequence[int] = DEFAULT_SIZES,
    context: int = 128,
    repeats: int = 7,
) -> CostCurve:
    """Time verification forwards (a chain-shaped tree mask over ``context`` cached tokens).

    The sizes are timed in rounds, one forward of each size per round, and each size keeps its
    median: a machine whose speed drifts while the curve is measured (a shared VM) then shifts
    every size alike instead of tilting the curve. The first round warms up and is dropped.
    Each round runs the sizes largest first: a small forward right after a large one runs slow
    for several forwards (measured on a 2-core Xeon, SmolLM2 fp32: one token 10.4 ms right after
    a 64-token forward, 7.3 ms ten forwards later), and decoding runs small forwards back to
    back, so timing one token after 64 (ascending order) made every tree look ~1.3x cheaper
    relative to one token than it is; largest first, each size follows one a little larger."""
    device, dtype = target.device, target.dtype
    generator = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=generator).to(device)
    times: dict[int, list[float]] = {size: [] for size in sizes}
    with torch.inference_mode():
        cache = target.new_cache()
        target.features(prompt, torch.arange(context, device=device)[None], cache)
        forwards = [
            _chain_forward(size, context, vocab, generator, device, dtype) for size in sizes
        ]
        largest_first = sorted(zip(sizes, forwards, strict=True), key=lambda item: -item[0])
        for run in range(repeats + 1):
            for size, (tokens, positions, mask) in largest_first:
                started = time.perf_counter()
                features = target.features(tokens, positions, cache, mask)
                target.logits(features)
                elapsed = elapsed_seconds(started, device)
                cache.crop(-size)  # negative: drop the tree's entries again
                if run:  # the first round warms up
                    times[size].append(elapsed)
    return CostCurve(sizes=tuple(sizes), seconds=tuple(statistics.median(times[s]) for s in sizes))


def _chain_forward(
    size: int,
    context: int,
    vocab: int,
    generator: torch.Generator,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens # [1, size], positions # [1, size] and a causal 4D mask # [1, 1, size, context +
    size] for a chain-shaped tree of ``size`` tokens after ``context`` cached ones."""
    tokens = torch.randint(0, vocab, (1, size), generator=generator).to(device)
    positions = torch.arange(context, context + size, device=device)[None]
    mask = torch.zeros(1, 1, size, context + size, dtype=dtype, device=device)
    blocked = torch.ones(size, size, dtype=torch.bool, device=device).triu(1)
    mask[0, 0, :, context:].masked_fill_(blocked, torch.finfo(dtype).min)
    return tokens, positions, mask


def cached_cost_curve(
    target: TargetForward, cache_dir: Path, sizes: Sequence[int] = DEFAULT_SIZES
) -> CostCurve:
    """The curve for this model, dtype, thread count and machine: read from ``cache_dir`` or
    measured (a few seconds) and written there."""
    path = cache_dir / f"cost-curve-{_machine_key(target, sizes)}.json"
    if path.is_file():
        try:
            return CostCurve.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as error:  # a damaged cache is remeasured
            logger.warning("ignoring unreadable cost curve %s: %s", path, error)
    logger.info("measuring the verification cost curve (cached in %s)", path)
    curve = measure_cost_curve(target, sizes)
    write_text_atomic(path, json.dumps(curve.to_dict(), indent=2) + "\n")
    return curve


def _machine_key(target: TargetForward, sizes: Sequence[int]) -> str:
    parts = [
        fingerprint_of(target.model).describe(),
        str(target.dtype),
        f"packed={is_packed(target.model)}",
        f"kernels={kernel_mode_of(target.model)}:{kernel_isa()}",
        # the kernels' sources: a new build (faster or slower) is measured again
        extension.build_key() if kernel_mode_of(target.model) else "",
        ",".join(sorted({type(layer).__name__ for layer in target.new_cache().layers})),
        f"lean={target.lean is not None}",
        str(target.device),
        *_gpu_model(target.device),
        str(torch.get_num_threads()),
        torch.__version__,
        platform.machine(),
        cpu_model(),
        ",".join(map(str, sizes)),
        "largest-first",  # how it is measured (ascending curves are measured again)
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _gpu_model(device: torch.device) -> list[str]:
    """The GPU's name on cuda (another card is measured again); nothing on a CPU, so CPU keys
    stay as they were."""
    return [torch.cuda.get_device_name(device)] if device.type == "cuda" else []


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """Which of the instruction sets that decide CPU decoding speed this CPU has (Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in CPU_FLAGS if flag in present]
    except OSError:
        pass
    return []


def machine_cost_curve(model: torch.nn.Module) -> CostCurve:
    """This machine's curve for ``model`` in its current dtype and thread count, cached under
    the selfspec cache directory (``$SELFSPEC_CACHE``, else ``~/.cache/selfspec``)."""
    from selfspec.target import cache_root

    return cached_cost_curve(TargetForward(model), cache_root())


def needs_cost_curve(tree: TreeSpec | None) -> bool:
    """Whether a request with this tree (None: the generator's default) reads the cost curve."""
    return tree is None or (isinstance(tree, DynamicTree) and tree.adaptive)
