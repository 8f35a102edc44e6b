"""Validate a peft LoRA adapter directory against a base model, before reading any weight.

Only the JSON config and the safetensors header (names, dtypes, shapes) are read here. What is
accepted is *plain* LoRA on linear layers of the decoder:

- `peft_type` LORA, weights in `adapter_model.safetensors` (a pickled `adapter_model.bin` is
  refused, with the one-liner that converts it);
- every LoRA tensor is `<module>.lora_A.weight` `[r, in]` or `<module>.lora_B.weight` `[out, r]`
  of a linear module of the base, with `r` within the rank limit, and the modules in the file
  are exactly those the config targets in this base (a missing pair would silently stay at
  its zero init);
- no variant that changes weights outside the LoRA delta or needs another forward: DoRA,
  LoRA bias / `bias != "none"`, `modules_to_save`, trainable tokens, layer replication,
  parameter targeting, aLoRA, QALoRA, and initialisations that rewrite the base (PiSSA, OLoRA,
  LoftQ, ...: `init_lora_weights` other than true / false / "gaussian").

Adapters on the token embedding or the lm_head are refused. Why: the draft heads run through the
target's own embedding and lm_head, so an adapted lm_head would change what the heads propose
and what the fingerprint of the base means; and peft's `adapter_names` batching (mixed-adapter
batches) does not cover embedding LoRA. Refusing is the honest choice until an adapter needs it.

Names must match `NAME_PATTERN`; with a root configured, the directory and every file in it must
resolve inside the root (no `..`, no symlink leading out, no hard link: one may share its data with
a file anywhere on the same filesystem). Errors name adapters by their path relative to the root,
never by the resolved absolute path.

A config is untrusted: its values are type- and bound-checked (`config_values.py`) and the regular
expressions peft would build from it are refused when they could backtrack badly (`patterns.py`)
before peft sees it. Every failure is an `AdapterError`, never a stray TypeError, RecursionError or
OSError.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from torch import nn

from selfspec.adapters.config_values import (
    check_config_values,
    check_depth,
    cut,
    short_repr,
)
from selfspec.adapters.errors import (
    AdapterError,
    AdapterPathError,
    CorruptAdapter,
    IncompatibleAdapter,
    InvalidAdapter,
    PickleAdapter,
    RankTooHigh,
    UnsafeAdapterName,
)
from selfspec.adapters.patterns import check_config_patterns
from selfspec.adapters.shipped import EXAMPLES_DIR
from selfspec.fingerprint import BaseFingerprint, FingerprintMismatch, check_compatible

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
META_FILE = "selfspec_adapter.json"
"""Optional, written by our recipes: `{"base": <fingerprint>, ...}`; checked when present."""
HEADS_DIR = "heads"
"""Optional heads recalibrated for this adapter, beside its weights."""
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight$")
_FLOAT_DTYPES = {"F32", "F16", "BF16"}
_CONVERT_HINT = (
    "convert it once, where you trust the file, with: python -c \"import torch; "
    "from safetensors.torch import save_file; save_file(torch.load('adapter_model.bin', "
    "weights_only=True), 'adapter_model.safetensors')\""
)
# Config fields that make an adapter something other than a plain LoRA delta on linear layers.
_TRUE_REFUSED = {"use_dora": "DoRA", "lora_bias": "LoRA bias", "use_qalora": "QALoRA"}
_SET_REFUSED = {
    "modules_to_save": "full-module copies (modules_to_save)",
    "trainable_token_indices": "trainable token embeddings",
    "layer_replication": "layer replication",
    "target_parameters": "parameter targeting",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow routing",
    "use_bdlora": "block-diagonal LoRA",
    "kasa_config": "KaSA",
}


@dataclass(frozen=True)
class AdapterLimits:
    """What the store accepts."""

    max_rank: int = 64
    """Largest LoRA rank of any module."""
    max_file_bytes: int = 512 << 20
    """Largest `adapter_model.safetensors`."""

    def __post_init__(self) -> None:
        if self.max_rank < 1 or self.max_file_bytes < 1:
            raise ValueError(f"adapter limits must be >= 1, got {self}")


@dataclass(frozen=True)
class BaseLayout:
    """What validation needs to know about the base: its linear modules and its embeddings."""

    linear: Mapping[str, tuple[int, int]]
    """Module name (as in `base.named_modules()`) -> (in_features, out_features)."""
    modules: frozenset[str]
    """Names of every module of the base."""
    embeddings: frozenset[str]
    """Names of the input embedding and lm_head modules (LoRA on them is refused)."""
    itemsize: int = 4
    """Bytes per element of the base dtype; resident LoRA weights are kept in it."""
    fingerprint: BaseFingerprint | None = None
    """Checked against an adapter's `selfspec_adapter.json` when both are known."""

    @classmethod
    def of(cls, base: nn.Module, fingerprint: BaseFingerprint | None = None) -> BaseLayout:
        """Layout of a plain (not peft-wrapped) HF causal LM."""
        special = {id(base.get_input_embeddings()), id(base.get_output_embeddings())}
        linear: dict[str, tuple[int, int]] = {}
        names, embeddings = set(), set()
        for name, module in base.named_modules():
            names.add(name)
            if id(module) in special:
                embeddings.add(name)
            elif (dims := _linear_dims(module)) is not None:
                linear[name] = dims
        itemsize = base.get_input_embeddings().weight.element_size()
        return cls(linear, frozenset(names), frozenset(embeddings), itemsize, fingerprint)


@dataclass(frozen=True)
class AdapterInfo:
    """A validated adapter: everything known from its config and header. No weights."""

    name: str
    path: Path
    """Resolved adapter directory."""
    config: Mapping[str, Any]
    """`adapter_config.json` restricted to the fields this peft knows (see `ignored_fields`)."""
    modules: tuple[str, ...]
    """Base modules it adapts, sorted."""
    max_rank: int
    """Largest rank over its modules."""
    num_tensors: int
    nbytes: int
    """Bytes its weights take once resident, in the base dtype."""
    weights_size: int
    """Size of the weights file in bytes when validated (`load` validates again anyway)."""
    weights_mtime_ns: int
    ignored_fields: tuple[str, ...] = ()
    """Config keys unknown to this peft whose value was empty, dropped."""
    heads_path: Path | None = None
    """`<adapter>/heads` when the adapter carries its own recalibrated heads."""
    root: Path | None = None
    """Resolved adapters root it was validated under; None without one."""

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS_FILE

    @property
    def display_path(self) -> str:
        """Where the adapter is, fit to show a client: its directory relative to the adapters
        root (POSIX separators), or its name when there is no root. Never an absolute path."""
        if self.root is not None and self.path.is_relative_to(self.root):
            return self.path.relative_to(self.root).as_posix()
        return self.name

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "display_path": self.display_path,
            "modules": len(self.modules),
            "max_rank": self.max_rank,
            "lora_alpha": self.config.get("lora_alpha"),
            "nbytes": self.nbytes,
            "heads": str(self.heads_path) if self.heads_path else None,
        }


def check_name(name: object) -> str:
    """`name` if it matches `NAME_PATTERN`; else `UnsafeAdapterName`."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise UnsafeAdapterName(
            f"adapter name {short_repr(name)} is not allowed: expected 1-64 characters of "
            "letters, digits, '.', '_' or '-', starting with a letter or digit (no path characters)"
        )
    return name


def resolve_adapter_dir(path: str | Path, root: Path | None) -> Path:
    """Resolved directory of an adapter; with `root`, it must lie strictly inside the root and
    the path may not contain `..` (an operator-given path without a root is taken as is)."""
    given = Path(path).expanduser()
    if root is not None and ".." in given.parts:
        raise AdapterPathError(
            f"adapter path {str(path)!r} contains '..'; give a plain path inside the root"
        )
    if root is not None:
        real_root = root.resolve()
        resolved = (given if given.is_absolute() else real_root / given).resolve()
        if resolved == real_root or not resolved.is_relative_to(real_root):
            raise AdapterPathError(
                f"adapter path {str(path)!r} resolves outside the adapters root (symlinks are "
                "followed before the check)"
            )
    else:
        resolved = given.resolve()
    if not resolved.is_dir():
        raise AdapterPathError(f"adapter path {str(path)!r} is not an existing directory")
    return resolved


def validate_adapter(
    name: str,
    path: str | Path,
    layout: BaseLayout,
    limits: AdapterLimits = AdapterLimits(),
    root: Path | None = None,
) -> AdapterInfo:
    """Check that `path` holds a plain LoRA adapter fitting the base `layout`; read no weight.
    Any failure is an `AdapterError` naming the adapter (I/O errors included)."""
    check_name(name)
    try:
        return _validate(name, path, layout, limits, root)
    except AdapterError:
        raise
    except (OSError, RecursionError, OverflowError, MemoryError) as error:
        raise InvalidAdapter(
            f"adapter {name!r} ({_shown(path, root)}) cannot be validated: "
            f"{_describe(error)}"
        ) from error


def _validate(
    name: str, path: str | Path, layout: BaseLayout, limits: AdapterLimits, root: Path | None
) -> AdapterInfo:
    directory = resolve_adapter_dir(path, root)
    # Without a root the operator named the path: show it as given, not resolved.
    where = f"adapter {name!r} ({_shown(directory if root is not None else path, root)})"
    config_path = _file_inside(directory, CONFIG_FILE, root, where)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.exists():
        pickles = [p for p in PICKLE_FILES if (directory / p).exists()]
        if pickles:
            raise PickleAdapter(
                f"{where} stores its weights as a pickle ({pickles[0]}), which selfspec never "
                f"loads: {_CONVERT_HINT}"
            )
        raise InvalidAdapter(f"{where} has no {WEIGHTS_FILE}")
    weights_path = _file_inside(directory, WEIGHTS_FILE, root, where)
    raw = _read_config(config_path, where)
    config, ignored = _plain_lora_config(raw, where)
    _check_meta(directory, layout, root, where)
    stat = weights_path.stat()
    if stat.st_size > limits.max_file_bytes:
        raise InvalidAdapter(
            f"{where}: {WEIGHTS_FILE} is {stat.st_size} bytes, above the limit of "
            f"{limits.max_file_bytes}"
        )
    for rank in [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise InvalidAdapter(
                f"{where}: {CONFIG_FILE}: LoRA rank must be an int >= 1, got {short_repr(rank)}"
            )
        if rank > limits.max_rank:
            raise RankTooHigh(
                f"{where}: {CONFIG_FILE} gives LoRA rank {short_repr(rank)}, above the limit of "
                f"{limits.max_rank}"
            )
    targeted = _targeted_modules(config, layout, where)
    shapes = _header_shapes(weights_path, where)
    modules, max_rank, numel = _check_tensors(shapes, layout, limits, where)
    if targeted != set(modules):
        missing, extra = sorted(targeted - set(modules)), sorted(set(modules) - targeted)
        raise IncompatibleAdapter(
            f"{where}: its config targets {len(targeted)} modules of this base but its weights "
            f"hold {len(modules)}; without weights: {missing[:3]}, not targeted: {extra[:3]}"
        )
    heads = _heads_inside(directory, root, where)
    return AdapterInfo(
        name=name,
        path=directory,
        config=config,
        modules=tuple(sorted(modules)),
        max_rank=max_rank,
        num_tensors=len(shapes),
        nbytes=numel * layout.itemsize,
        weights_size=stat.st_size,
        weights_mtime_ns=stat.st_mtime_ns,
        ignored_fields=ignored,
        heads_path=heads,
        root=root.resolve() if root is not None else None,
    )


def _shown(path: str | Path, root: Path | None) -> str:
    """`path` as errors show it: relative to the root when inside it, else as given."""
    if root is not None:
        real_root = root.resolve()
        absolute = Path(path) if Path(path).is_absolute() else real_root / path
        if absolute.is_relative_to(real_root):
            return absolute.relative_to(real_root).as_posix()
        return Path(path).name
    return str(path)


def _describe(error: BaseException) -> str:
    """An exception's message without the absolute file names an OSError carries."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {cut(str(error))}"


def _heads_inside(directory: Path, root: Path | None, where: str) -> Path | None:
    """`<adapter>/heads` when it holds a heads checkpoint; with a root, it and each file in it
    must lie inside the root, like the adapter's own files."""
    heads = directory / HEADS_DIR
    if not (heads / "config.json").is_file():
        return None
    if root is None:
        return heads
    resolved = heads.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise AdapterPathError(f"{where}: {HEADS_DIR}/ is a link leading outside the adapters root")
    for child in sorted(heads.iterdir()):
        if child.is_file():
            _file_inside(heads, child.name, root, f"{where}: {HEADS_DIR}/")
    return heads


def _file_inside(directory: Path, filename: str, root: Path | None, where: str) -> Path:
    """Resolved `directory/filename`; with a root, neither a symlink leading out of it nor a hard
    link (whose other names could lie anywhere on the filesystem)."""
    path = directory / filename
    if not path.is_file():
        raise InvalidAdapter(f"{where} has no {filename}")
    resolved = path.resolve()
    if root is None:
        return resolved
    real_root = root.resolve()
    if not resolved.is_relative_to(real_root):
        raise AdapterPathError(f"{where}: {filename} is a link to a file outside the adapters root")
    links = resolved.stat().st_nlink
    # The package's own examples are trusted like its code (installers such as uv hard-link the
    # files of a package to their cache).
    if links > 1 and real_root != EXAMPLES_DIR.resolve():
        raise AdapterPathError(
            f"{where}: {filename} is a hard link ({links} names for one file), which may share its "
            "data with a file outside the adapters root; replace it with a copy"
        )
    return resolved


def _read_config(path: Path, where: str) -> dict[str, Any]:
    """The JSON object in `path` (the config or the meta file), read with bounded size and depth."""
    filename = path.name
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise InvalidAdapter(f"{where}: {filename} is larger than {MAX_CONFIG_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise InvalidAdapter(
            f"{where}: {filename} cannot be read: {_describe(error)}"
        ) from error
    except UnicodeDecodeError as error:
        raise InvalidAdapter(f"{where}: {filename} is not UTF-8 text: {error}") from error
    try:
        data = json.loads(text)
    # ValueError: a malformed document (JSONDecodeError) or an int of more than 4,300 digits;
    # RecursionError: arrays or objects nested thousands of levels deep.
    except (ValueError, RecursionError) as error:
        why = "it is nested too deeply" if isinstance(error, RecursionError) else error
        raise InvalidAdapter(
            f"{where}: {filename} is not valid JSON: {cut(str(why))}"
        ) from None
    if not isinstance(data, dict):
        raise InvalidAdapter(f"{where}: {filename} must hold a JSON object")
    check_depth(data, f"{where}: {filename}")
    return data


def _plain_lora_config(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The config restricted to known LoraConfig fields; refuses anything but plain LoRA."""
    from peft import LoraConfig

    if raw.get("peft_type") != "LORA":
        raise InvalidAdapter(
            f"{where} is a {short_repr(raw.get('peft_type'))} adapter; only peft LoRA "
            "(peft_type LORA) is supported"
        )
    for key, what in _TRUE_REFUSED.items():
        if raw.get(key):
            raise InvalidAdapter(f"{where} uses {what}; only plain LoRA adapters are supported")
    for key, what in _SET_REFUSED.items():
        if raw.get(key) not in (None, False, [], {}, ""):
            raise InvalidAdapter(f"{where} uses {what}; only plain LoRA adapters are supported")
    init = raw.get("init_lora_weights", True)
    if init not in (True, False, "gaussian"):
        raise InvalidAdapter(
            f"{where} was initialised with init_lora_weights={short_repr(init)}, which rewrites "
            "the base weights (PiSSA, OLoRA, LoftQ, ...) so it is not a delta on this base; "
            "convert it to plain LoRA first "
            "(peft save_pretrained(path_initial_model_for_weight_conversion=...))"
        )
    if raw.get("bias", "none") != "none":
        raise InvalidAdapter(
            f"{where} trains biases of the base (bias={short_repr(raw.get('bias'))}); only "
            "bias='none' keeps the base weights untouched"
        )
    if not raw.get("target_modules"):
        raise InvalidAdapter(f"{where}: {CONFIG_FILE} names no target_modules")
    check_config_values(raw, f"{where}: {CONFIG_FILE}")
    check_config_patterns(raw, f"{where}: {CONFIG_FILE}")
    known = {f.name for f in fields(LoraConfig) if f.init}
    unknown = sorted(set(raw) - known)
    meaningful = [k for k in unknown if raw[k] not in (None, False, [], {}, "")]
    if meaningful:
        raise InvalidAdapter(
            f"{where}: {CONFIG_FILE} has fields this peft does not know: "
            f"{short_repr(meaningful, 200)} (made by a "
            "newer peft?); refusing rather than ignoring them"
        )
    return {k: v for k, v in raw.items() if k in known}, tuple(unknown)


def _check_meta(directory: Path, layout: BaseLayout, root: Path | None, where: str) -> None:
    if not (directory / META_FILE).is_file() or layout.fingerprint is None:
        return
    data = _read_config(_file_inside(directory, META_FILE, root, where), where)
    base = data.get("base")
    if base is None:
        return
    try:
        check_compatible(BaseFingerprint.from_dict(base), layout.fingerprint, what=where)
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        kind = IncompatibleAdapter if isinstance(error, FingerprintMismatch) else InvalidAdapter
        raise kind(f"{where}: {META_FILE}: {error}") from error


def _header_shapes(path: Path, where: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor name -> (dtype, shape), from the header only. Truncated files fail here."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            out = {}
            for key in handle.keys():  # noqa: SIM118 -- safe_open is not a Mapping
                tensor_slice = handle.get_slice(key)
                out[key] = (tensor_slice.get_dtype(), tuple(tensor_slice.get_shape()))
            return out
    except OSError as error:
        raise InvalidAdapter(
            f"{where}: {WEIGHTS_FILE} cannot be read: {_describe(error)}"
        ) from error
    except (SafetensorError, ValueError, RuntimeError, OverflowError) as error:
        raise CorruptAdapter(
            f"{where}: {WEIGHTS_FILE} is not a complete safetensors file (truncated or "
            f"corrupt?): {cut(str(error))}"
        ) from error


def _check_tensors(
    shapes: Mapping[str, tuple[str, tuple[int, ...]]],
    layout: BaseLayout,
    limits: AdapterLimits,
    where: str,
) -> tuple[dict[str, int], int, int]:
    """module -> rank, largest rank, total elements."""
    if not shapes:
        raise InvalidAdapter(f"{where}: {WEIGHTS_FILE} holds no tensors")
    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    numel = 0
    for key, (dtype, shape) in shapes.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise InvalidAdapter(
                f"{where}: tensor {key!r} is not a LoRA A/B weight of a linear module "
                "(embedding LoRA, DoRA magnitudes and saved modules are not supported)"
            )
        if dtype not in _FLOAT_DTYPES or len(shape) != 2:
            raise InvalidAdapter(
                f"{where}: tensor {key!r} is {dtype} {list(shape)}, expected a 2D float tensor"
            )
        parts.setdefault(match["module"], {})[match["part"]] = shape
        numel += math.prod(shape)
    ranks: dict[str, int] = {}
    for module, pair in sorted(parts.items()):
        if module in layout.embeddings:
            raise InvalidAdapter(
                f"{where} adapts {module!r}, the token embedding or lm_head: refused, because the "
                "draft heads share these modules with the target (see selfspec.adapters.validate)"
            )
        if module not in layout.linear:
            what = "is not a linear layer of" if module in layout.modules else "does not exist in"
            raise IncompatibleAdapter(f"{where}: module {module!r} {what} the loaded base")
        if set(pair) != {"lora_A", "lora_B"}:
            raise InvalidAdapter(f"{where}: module {module!r} lacks one of lora_A / lora_B")
        (rank, a_in), (b_out, b_rank) = pair["lora_A"], pair["lora_B"]
        expected_in, expected_out = layout.linear[module]
        if (a_in, b_out) != (expected_in, expected_out) or rank != b_rank:
            raise IncompatibleAdapter(
                f"{where}: module {module!r} has lora_A {list(pair['lora_A'])} and lora_B "
                f"{list(pair['lora_B'])}; the base needs [r, {expected_in}] and "
                f"[{expected_out}, r] (an adapter for another base?)"
            )
        if rank > limits.max_rank:
            raise RankTooHigh(
                f"{where}: module {module!r} has LoRA rank {rank}, above the limit of "
                f"{limits.max_rank}"
            )
        ranks[module] = rank
    return ranks, max(ranks.values()), numel


def _targeted_modules(config: Mapping[str, Any], layout: BaseLayout, where: str) -> set[str]:
    """Linear modules of the base that peft would adapt under `config`."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    try:
        lora = LoraConfig(**config)
        if lora.target_modules == "all-linear":
            return set(layout.linear)
        # Only the base's own module names are matched; the patterns were bounded beforehand.
        targeted = {
            name
            for name in layout.modules
            if name and check_target_module_exists(lora, name)
        }
    except (TypeError, ValueError, KeyError, AttributeError, re.error) as error:
        raise InvalidAdapter(
            f"{where}: {CONFIG_FILE} is not a valid LoRA config: {cut(str(error))}"
        ) from error
    if not targeted:
        raise IncompatibleAdapter(
            f"{where}: its target_modules {short_repr(lora.target_modules, 200)} do not exist in "
            "the loaded base (an adapter for another architecture?)"
        )
    for name in sorted(targeted):
        if name in layout.embeddings:
            raise InvalidAdapter(
                f"{where} targets {name!r}, the token embedding or lm_head: refused, because the "
                "draft heads share these modules with the target (see selfspec.adapters.validate)"
            )
        if name not in layout.linear:
            raise IncompatibleAdapter(
                f"{where} targets {name!r}, which is not a linear layer of the loaded base"
            )
    return targeted


def _linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a linear layer: nn.Linear, or transformers' Conv1D (weight [in, out])."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return int(module.weight.shape[0]), int(module.nf)
    return None
