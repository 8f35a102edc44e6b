"""Per-adapter draft deltas: low-rank corrections of the shared heads, one per adapter.

Heads recalibrated for an adapter used to be full copies (~18 MB each for the default model's
EAGLE heads); a delta keeps the shared heads and stores, for every linear layer W of the heads,
a rank-r pair (A # [r, in], B # [out, r]) with W' = W + (alpha / r) B A. At rank 16 that is
~4 % of the heads, so a thousand adapters' deltas fit in well under a gigabyte.

- Training (``with_trainable_delta``): each linear layer is wrapped in ``LoraLinear`` (A random,
  B zero, so training starts from the shared heads exactly); only A and B train.
- Serving (``DeltaBank``): each linear layer is wrapped in ``BankedLinear``, which holds every
  registered adapter's pair and applies the active one; ``bank.active(name)`` selects it for the
  duration of a request's drafting (None: the shared heads alone). Switching is a pointer; the
  shared weights are never copied or changed.
- Draft vocabulary: a delta may carry its own (``Delta.draft_vocab``: recalibration gives it
  the shared heads' plus the adapter's own response tokens, ~68 KB of ids); while it is active
  the drafts' projection reads those rows of the target's lm_head in place
  (``selfspec.drafting.projection``).
- Files (``save_delta`` / ``load_delta``): ``delta.safetensors`` (``<module>.lora_A`` /
  ``<module>.lora_B``, and ``draft_vocab`` if it has one) and ``delta.json`` (rank, alpha,
  modules, and the hash of the shared heads they correct: a delta is refused on other heads).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from selfspec.atomic import replace_dir, staging_dir_for
from selfspec.heads.draft_vocab import check_draft_vocab

DELTA_DIR = "heads-delta"
"""Where an adapter directory keeps its draft delta."""
WEIGHTS_FILE = "delta.safetensors"
VOCAB_KEY = "draft_vocab"
"""The delta's own draft vocabulary in its weights file, when it has one (int64 [N])."""
BANK_ATTRIBUTE = "_selfspec_delta_bank"
CONFIG_FILE = "delta.json"


class DeltaError(ValueError):
    """A draft delta that cannot be used (malformed, or for other heads)."""


@dataclass(frozen=True)
class DeltaConfig:
    rank: int = 16
    alpha: float = 32.0

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= 256 or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"need 1 <= rank <= 256 and alpha > 0, got {self.rank}, {self.alpha}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def delta_modules(heads: nn.Module) -> list[str]:
    """Names of the heads' linear layers a delta corrects (all of them)."""
    return [name for name, module in heads.named_modules() if isinstance(module, nn.Linear)]


def linear_layers(heads: nn.Module) -> dict[str, nn.Linear]:
    """The heads' shared linear layers by name, whether plain or wrapped for a delta."""
    found = {}
    for name, module in heads.named_modules():
        if isinstance(module, LoraLinear | BankedLinear):
            found[name] = module.base
        elif isinstance(module, nn.Linear):
            parent = heads.get_submodule(name.rpartition(".")[0]) if "." in name else heads
            if not isinstance(parent, LoraLinear | BankedLinear):
                found[name] = module
    return found


def heads_hash(heads: nn.Module) -> str:
    """16 hex digits of a sha256 over the shared heads' linear weights (what a delta corrects)."""
    digest = hashlib.sha256()
    for name, layer in sorted(linear_layers(heads).items()):
        digest.update(name.encode())
        digest.update(layer.weight.detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


# -- training -----------------------------------------------------------------------------------


class LoraLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank term. # [..., in] -> [..., out]"""

    def __init__(self, base: nn.Linear, config: DeltaConfig) -> None:
        super().__init__()
        self.base = base
        self.scale = config.scale
        device = base.weight.device  # trained beside the heads, wherever they are
        self.lora_A = nn.Parameter(torch.empty(config.rank, base.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, config.rank, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        base.requires_grad_(False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = (x @ self.lora_A.T.to(x.dtype)) @ self.lora_B.T.to(x.dtype)  # [..., out]
        return self.base(x) + self.scale * low


def with_trainable_delta(heads: nn.Module, config: DeltaConfig) -> nn.Module:
    """``heads`` (changed in place) with every linear layer wrapped in ``LoraLinear``; only the
    low-rank parameters require gradients."""
    heads.requires_grad_(False)
    for name in delta_modules(heads):
        _replace(heads, name, LoraLinear(heads.get_submodule(name), config))
    return heads


def delta_state(heads: nn.Module) -> dict[str, torch.Tensor]:
    """The trained pairs of heads made by ``with_trainable_delta``."""
    state = {}
    for name, module in heads.named_modules():
        if isinstance(module, LoraLinear):
            state[f"{name}.lora_A"] = module.lora_A.detach().float().contiguous().cpu()
            state[f"{name}.lora_B"] = module.lora_B.detach().float().contiguous().cpu()
    if not state:
        raise DeltaError("these heads carry no trainable delta (with_trainable_delta)")
    return state


# -- files --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Delta:
    config: DeltaConfig
    heads_hash: str
    state: dict[str, torch.Tensor]  # <module>.lora_A # [r, in], <module>.lora_B # [out, r]
    draft_vocab: torch.Tensor | None = None
    """# [N] token ids (ascending) the adapter's drafts come from, or None: the shared heads'.
    An adapter that shifts what the target writes shifts its frequent tokens too: the default
    model's `shout` (capitals): its 8192 most frequent share 605 with the base's, and its heads
    recalibrated in full reach τ 1.91 drafting from their own, 1.61 from the base's."""

    @property
    def nbytes(self) -> int:
        vocab = 0 if self.draft_vocab is None else self.draft_vocab.nbytes
        return sum(t.nbytes for t in self.state.values()) + vocab


def save_delta(delta: Delta, directory: Path, extra: dict | None = None) -> Path:
    """Write ``directory`` atomically (complete or absent; an old one survives a failure)."""
    directory = Path(directory)
    staging = staging_dir_for(directory)
    try:
        tensors = dict(delta.state)
        if delta.draft_vocab is not None:
            tensors[VOCAB_KEY] = delta.draft_vocab.long().contiguous()
        save_file(tensors, str(staging / WEIGHTS_FILE))
        record = {
            **asdict(delta.config),
            "heads_hash": delta.heads_hash,
            "modules": sorted({key.rsplit(".", 1)[0] for key in delta.state}),
            "draft_vocab_size": 0 if delta.draft_vocab is None else int(delta.draft_vocab.numel()),
            "bytes": delta.nbytes,
            **(extra or {}),
        }
        (staging / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")
        replace_dir(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def load_delta(directory: Path, heads: nn.Module, known_hash: str | None = None) -> Delta:
    """A delta for ``heads`` (the shared heads, plain or banked); DeltaError naming what is
    wrong: missing or malformed files, other heads, unknown modules, wrong shapes.
    ``known_hash``: ``heads_hash(heads)`` when the caller holds it (a ``DeltaBank``'s ``hash``),
    saving a pass over the heads' weights per load (~12 ms of a ~13 ms load on the default
    model's EAGLE heads)."""
    directory = Path(directory)
    shared_hash = known_hash if known_hash is not None else heads_hash(heads)
    try:
        record = json.loads((directory / CONFIG_FILE).read_text())
        config = DeltaConfig(rank=int(record["rank"]), alpha=float(record["alpha"]))
        recorded = str(record["heads_hash"])
        state = load_file(str(directory / WEIGHTS_FILE))
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
        raise DeltaError(f"{directory}: not a readable draft delta: {error}") from error
    vocab = state.pop(VOCAB_KEY, None)
    if vocab is not None:
        try:
            vocab = check_draft_vocab(vocab, heads.config.vocab_size, int(vocab.numel()))
        except ValueError as error:
            raise DeltaError(f"{directory}: its draft vocabulary: {error}") from error
    if recorded != shared_hash:
        raise DeltaError(
            f"{directory}: the delta corrects other heads (hash {recorded}, these heads "
            f"{shared_hash}); recalibrate it for the heads in use"
        )
    shapes = {
        name: (layer.out_features, layer.in_features)
        for name, layer in linear_layers(heads).items()
    }
    for key, tensor in state.items():
        module, _, part = key.rpartition(".")
        if module not in shapes or part not in ("lora_A", "lora_B"):
            raise DeltaError(f"{directory}: {key!r} names no linear layer of the heads")
        out, inp = shapes[module]
        want = (config.rank, inp) if part == "lora_A" else (out, config.rank)
        if tuple(tensor.shape) != want or not torch.isfinite(tensor).all():
            raise DeltaError(
                f"{directory}: {key} has shape {tuple(tensor.shape)} (want {want}) or "
                "non-finite values"
            )
        if f"{module}.{'lora_B' if part == 'lora_A' else 'lora_A'}" not in state:
            raise DeltaError(f"{directory}: {key} has no partner")
    return Delta(config, recorded, state, vocab)


# -- serving ------------------------------------------------------------------------------------


class BankedLinear(nn.Module):
    """A shared linear layer and every registered adapter's low-rank pair; the bank's active
    adapter's pair applies. # [..., in] -> [..., out]"""

    def __init__(self, base: nn.Linear, bank: DeltaBank) -> None:
        super().__init__()
        self.base = base
        self._bank = bank
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        pair = self.pairs.get(self._bank.current)
        if pair is None:
            return y
        a, b, scale = pair
        return y + scale * ((x @ a.T.to(x.dtype)) @ b.T.to(x.dtype))


class DeltaBank:
    """Draft deltas of many adapters over one set of shared heads."""

    def __init__(self, heads: nn.Module) -> None:
        self.heads = heads
        self.hash = heads_hash(heads)
        self._local = threading.local()
        self._layers: dict[str, BankedLinear] = {}
        for name in delta_modules(heads):
            layer = BankedLinear(heads.get_submodule(name), self)
            _replace(heads, name, layer)
            self._layers[name] = layer
        self._bytes: dict[str, int] = {}
        self._vocabs: dict[str, torch.Tensor] = {}
        setattr(heads, BANK_ATTRIBUTE, self)  # found by the drafts' projection (active_draft_vocab)

    @property
    def current(self) -> str | None:
        """The adapter whose delta applies on this thread (None: the shared heads alone)."""
        return getattr(self._local, "name", None)

    @contextlib.contextmanager
    def active(self, name: str | None) -> Iterator[None]:
        previous = self.current
        self._local.name = name if name in self._bytes else None
        try:
            yield
        finally:
            self._local.name = previous

    def add(self, name: str, delta: Delta) -> None:
        if delta.heads_hash != self.hash:
            raise DeltaError(f"the delta of {name!r} corrects other heads than this bank's")
        device = next(iter(self._layers.values())).base.weight.device
        scale = delta.config.scale
        for module, layer in self._layers.items():
            a, b = delta.state.get(f"{module}.lora_A"), delta.state.get(f"{module}.lora_B")
            if a is not None and b is not None:
                layer.pairs[name] = (a.to(device), b.to(device), scale)
        if delta.draft_vocab is not None:
            self._vocabs[name] = delta.draft_vocab.to(device)
        else:
            self._vocabs.pop(name, None)
        self._bytes[name] = delta.nbytes

    def remove(self, name: str) -> None:
        for layer in self._layers.values():
            layer.pairs.pop(name, None)
        self._bytes.pop(name, None)
        self._vocabs.pop(name, None)

    def active_draft_vocab(self) -> torch.Tensor | None:
        """The active adapter's own draft vocabulary # [N], or None (the shared heads')."""
        name = self.current
        return None if name is None else self._vocabs.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._bytes

    @property
    def nbytes(self) -> int:
        """Bytes of every registered delta (the shared heads not counted)."""
        return sum(self._bytes.values())


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def active_draft_vocab(heads: nn.Module) -> torch.Tensor | None:
    """The draft vocabulary of the delta active on ``heads`` for this thread, if it carries its
    own (``Delta.draft_vocab``); None otherwise (no bank, no delta active, or the shared one)."""
    bank = getattr(heads, BANK_ATTRIBUTE, None)
    return None if bank is None else bank.active_draft_vocab()
