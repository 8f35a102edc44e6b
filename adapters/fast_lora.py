"""Fast LoRA application for serving: every resident adapter's weights stacked per base layer.

peft injects one `LoraLayer` per adapted module and one branch per adapter; its forward walks
Python dicts per layer, and switching (`set_adapter`) walks every layer. For serving many adapters
over one base we want the opposite: a switch that costs an int, a per-token cost close to the
bare LoRA matmuls, and mixed-adapter batches without a Python loop over rows.

`LoraBank` owns, per adapted base linear module (`nn.Linear`, or transformers' `Conv1D`), the
stacked weights of all resident adapters:

    A:  # [slots, r_max, in]          lora_A of each adapter, zero-padded to r_max
    Bt: # [slots, r_max, out]         (lora_B * scale).T: the LoRA scale is folded in once

Slot 0 is all zeros: the base. A forward hook on the base module (removable handle; all state in
the bank, nothing on the HF module but the hook) adds the delta to the module's output:

- one adapter owns the whole batch (`select(name)`): `x @ A[s, :r].T @ Bt[s, :r]`, two plain
  matmuls on that adapter's own rank (no gather, no padding), or nothing for the base;
- a mixed batch (`select_rows(names)`, one name per batch row; the tree tokens of one request are
  one row): Punica's shrink / expand in plain torch, per row `x_i @ A[idx_i].T @ Bt[idx_i]`:
  gather each row's A and Bt, then `bmm` (shrink to r_max) and `baddbmm` (expand, added onto the
  base output). No loop over adapters or rows.

Switching is setting `select(...)`'s slot: no module walk, no weight copy. The delta is computed
as `(x A^T) (s B)^T`, peft's `s ((x A^T) B^T)` up to float rounding; zero padding adds exact zeros.

What it represents exactly is checked by `unsupported_reason`: plain LoRA (scale `alpha / r`, or
`alpha / sqrt(r)` with rsLoRA, per-module `rank_pattern` / `alpha_pattern` resolved with peft's
own matcher) on linear modules. Anything else is reported so the caller can fall back to peft.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from selfspec.linear_deltas import mark_delta_hook

_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight$")
UNDERSTOOD_FIELDS = frozenset(
    {
        # What the delta is: rank, alpha and how they scale it.
        "r",
        "lora_alpha",
        "use_rslora",
        "rank_pattern",
        "alpha_pattern",
        # Which modules are adapted: already resolved against the weights file by validation.
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        # Training-time only: dropout is the identity at inference, init is overwritten by the
        # file, fan_in_fan_out only changes how a delta would be merged into a Conv1D weight.
        "lora_dropout",
        "init_lora_weights",
        "fan_in_fan_out",
        "inference_mode",
        # Bookkeeping.
        "peft_type",
        "task_type",
        "auto_mapping",
        "base_model_name_or_path",
        "revision",
        "peft_version",
        "megatron_core",
    }
)
"""`LoraConfig` fields whose every value the bank represents exactly. Any other field set to a
non-default value makes `unsupported_reason` refuse the adapter (e.g. DoRA, LoRA bias, runtime or
initialisation configs): new peft features are never silently ignored."""


@dataclass(frozen=True)
class LoraWeights:
    """One adapted module of one adapter, as peft applies it: `scale * B(A(x))`."""

    lora_A: torch.Tensor
    """# [rank, in]"""
    lora_B: torch.Tensor
    """# [out, rank]"""
    scale: float

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[0])


def is_linear(module: nn.Module) -> bool:
    """An `nn.Linear`, or transformers' `Conv1D` (GPT-2; weight [in, out], same LoRA forward)."""
    return isinstance(module, nn.Linear) or (
        type(module).__name__ == "Conv1D" and hasattr(module, "nf")
    )


def _dims(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return int(module.weight.shape[0]), int(module.nf)


def unsupported_reason(
    config: Mapping[str, Any], modules: Iterable[str], linear: Collection[str]
) -> str | None:
    """Why the bank cannot apply this (validated) adapter exactly, or None if it can.
    `linear`: names of the base's linear modules (`LoraBank.linear_names`)."""
    from peft import LoraConfig

    defaults = LoraConfig()
    for key, value in sorted(config.items()):
        if key in UNDERSTOOD_FIELDS:
            continue
        default = getattr(defaults, key, None)
        if value in (None, False, [], {}, "") or value == default:
            continue
        if dataclasses.is_dataclass(default) and value == dataclasses.asdict(default):
            continue
        return f"config field {key}={value!r} is not applied by the fast LoRA path"
    for name in modules:
        if name not in linear:
            return f"module {name!r} is not a linear layer (nn.Linear or Conv1D) of the base"
    return None


def weights_from_state(
    state: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> dict[str, LoraWeights]:
    """Module name -> LoRA weights and scale, from a peft adapter state dict (the keys of
    `adapter_model.safetensors`). Rank and alpha per module resolve as peft resolves them.
    Raises ValueError when a tensor is missing or its rank differs from what the config says."""
    from peft.utils.other import get_pattern_key

    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"tensor {key!r} is not a LoRA A/B weight of a linear module")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    default_rank, default_alpha = config.get("r", 8), config.get("lora_alpha", 8)
    out = {}
    for module, pair in sorted(parts.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"module {module!r} lacks one of lora_A / lora_B")
        rank = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), default_rank)
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), default_alpha)
        lora_a, lora_b = pair["lora_A"], pair["lora_B"]  # [r, in], [out, r]
        if lora_a.shape[0] != rank or lora_b.shape[1] != rank:
            raise ValueError(
                f"module {module!r}: the config gives rank {rank}, the weights have lora_A "
                f"{list(lora_a.shape)} and lora_B {list(lora_b.shape)}"
            )
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        out[module] = LoraWeights(lora_a, lora_b, float(scale))
    return out


@mark_delta_hook
class _ModuleLora:
    """The stacked LoRA weights of one base linear module, and the forward hook that adds them
    (a delta hook: the fused body adds the same delta itself, ``selfspec.linear_deltas``)."""

    def __init__(self, bank: LoraBank, module: nn.Module, capacity: int) -> None:
        self.bank = bank
        self.in_features, self.out_features = _dims(module)
        weight = module.weight
        self.A = weight.new_zeros(capacity, 0, self.in_features)  # [slots, r_max, in]
        self.Bt = weight.new_zeros(capacity, 0, self.out_features)  # [slots, r_max, out]
        self.ranks = [0] * capacity
        # Per slot: (A[s, :r].T # [in, r], Bt[s, :r] # [r, out]), views for the one-adapter path.
        self.single: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * capacity
        # (rows, A[rows].T # [batch, in, r_max], Bt[rows] # [batch, r_max, out]) of the last
        # mixed batch, reused while the bank's `rows` tensor is the same object.
        self.gathered: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.handle = module.register_forward_hook(self)

    @property
    def r_max(self) -> int:
        return int(self.A.shape[1])

    def staged(self, slot: int, weights: LoraWeights | None, capacity: int, r_max: int) -> tuple:
        """Stacks with `weights` in `slot` (None: zeros), for `commit`. Grown to `capacity` and
        `r_max` in new tensors (self unchanged); else written into `slot` in place, which is safe
        because `slot` is free (no row reads it; the bank keeps free slots all zero) or being
        freed. No copy of the stacks per load: peak memory stays at the stacks' size."""
        grow = capacity != self.A.shape[0] or r_max != self.r_max
        if grow:
            A = self.A.new_zeros(capacity, r_max, self.in_features)
            Bt = self.Bt.new_zeros(capacity, r_max, self.out_features)
            A[: self.A.shape[0], : self.r_max] = self.A
            Bt[: self.Bt.shape[0], : self.r_max] = self.Bt
        else:
            A, Bt = self.A, self.Bt
        ranks = self.ranks + [0] * (capacity - len(self.ranks))
        A[slot], Bt[slot] = 0, 0
        ranks[slot] = 0
        if weights is not None:
            rank = weights.rank
            A[slot, :rank] = weights.lora_A.to(A.dtype)
            Bt[slot, :rank] = (weights.lora_B * weights.scale).t().to(Bt.dtype)
            ranks[slot] = rank
        return A, Bt, ranks

    def commit(self, staged: tuple) -> None:
        self.A, self.Bt, self.ranks = staged
        self.single = [
            (self.A[s, :r].t(), self.Bt[s, :r]) if r else None for s, r in enumerate(self.ranks)
        ]
        self.gathered = None

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        bank = self.bank
        slot = bank.slot
        if slot is not None:
            pair = self.single[slot]
            if pair is None:
                return None  # the base, or an adapter that leaves this module alone
            a_t, b_t = pair  # [in, r], [r, out]
            # Bare aten calls on 2D views: at one token the cost is per op, not per flop.
            shrink = torch.mm(args[0].reshape(-1, self.in_features), a_t)  # [batch * tokens, r]
            if output.requires_grad or not output.is_contiguous():
                return output + (shrink @ b_t).view(output.shape)
            # In place: the base output is ours (fresh from the module); saves a copy per layer.
            output.view(-1, self.out_features).addmm_(shrink, b_t)
            return output
        rows = bank.rows  # [batch]
        x = args[0]  # [batch, tokens, in]
        if x.dim() != 3 or x.shape[0] != rows.shape[0]:
            raise ValueError(self._rows_mismatch(rows, list(x.shape)))
        _, a, b_t = self._gathered_for(rows)
        shrink = torch.bmm(x, a)  # [batch, tokens, r_max]
        if output.requires_grad:
            return torch.baddbmm(output, shrink, b_t)  # [batch, tokens, out]
        return output.baddbmm_(shrink, b_t)

    def fused_delta(self, batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What this hook would add in the next forward of ``batch`` rows, as tensors
        (``selfspec.linear_deltas``): the selected adapter's (A^T # [in, r], Bt # [r, out]),
        the rows' gathered (# [batch, in, r_max], # [batch, r_max, out]), or None."""
        if self.bank.slot is not None:
            return self.single[self.bank.slot]
        rows = self.bank.rows
        if batch != rows.shape[0]:
            raise ValueError(self._rows_mismatch(rows, [batch, "tokens", self.in_features]))
        _, a, b_t = self._gathered_for(rows)
        return a, b_t

    def _gathered_for(self, rows: torch.Tensor) -> tuple:
        """(rows, A[rows].T # [batch, in, r_max], Bt[rows] # [batch, r_max, out])."""
        if self.gathered is None or self.gathered[0] is not rows:
            # Gathered once per batch composition (a server keeps one for many steps), not per
            # forward: the copy is as large as the rows' LoRA weights.
            a = self.A.index_select(0, rows).transpose(1, 2)  # [batch, in, r_max]
            self.gathered = (rows, a, self.Bt.index_select(0, rows))  # ..., [batch, r_max, out]
        return self.gathered

    def _rows_mismatch(self, rows: torch.Tensor, shape: list) -> str:
        return (
            f"a mixed-adapter batch of {rows.shape[0]} rows was selected, but a linear layer "
            f"got input of shape {shape}; expected [{rows.shape[0]}, tokens, {self.in_features}]"
        )


class LoraBank:
    """Stacked LoRA weights of the resident adapters of one base model, applied by forward hooks.

    `add(name, weights)` / `remove(name)` change what is resident; `select(name)` (None: the base)
    or `select_rows(names)` (one per batch row) choose what the next forwards apply. Not thread
    safe: the caller (the adapter store) serialises use. `close()` removes every hook."""

    def __init__(self, model: nn.Module) -> None:
        if installed_on(model):
            raise TypeError("this model already carries a LoRA bank (one bank per base model)")
        self.model = model
        self._linear = {name: m for name, m in model.named_modules() if name and is_linear(m)}
        self._modules: dict[str, _ModuleLora] = {}
        self._slots: dict[str, int] = {}
        self._capacity = 1  # slot 0: the base
        self.slot: int | None = 0
        """The slot every row uses; None while `rows` is in force."""
        self.rows: torch.Tensor | None = None
        """# [batch] slot of each row, when a mixed batch is selected."""
        self._last_rows: tuple[list[int], torch.Tensor] | None = None

    # -- what is resident --------------------------------------------------------------------

    def names(self) -> tuple[str, ...]:
        return tuple(self._slots)

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked weights held now (free slots and rank padding included)."""
        return sum(e.A.nbytes + e.Bt.nbytes for e in self._modules.values())

    @property
    def linear_names(self) -> frozenset[str]:
        """Names of the base's linear modules, as they were when the bank was made."""
        return frozenset(self._linear)

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def add(self, name: str, weights: Mapping[str, LoraWeights]) -> int:
        """Make `name`'s weights resident in a free slot; returns the slot. Checks everything
        before changing anything: on error the bank is as it was."""
        if name in self._slots:
            raise ValueError(f"adapter {name!r} is already in the bank")
        if not weights:
            raise ValueError(f"adapter {name!r} adapts no module")
        for module, w in weights.items():
            base = self._linear.get(module)
            if base is None:
                raise ValueError(f"adapter {name!r}: {module!r} is not a linear layer of the base")
            fan_in, fan_out = _dims(base)
            if (
                w.lora_A.dim() != 2
                or w.lora_B.dim() != 2
                or tuple(w.lora_A.shape) != (w.rank, fan_in)
                or tuple(w.lora_B.shape) != (fan_out, w.rank)
            ):
                raise ValueError(
                    f"adapter {name!r}: module {module!r} needs lora_A [r, {fan_in}] and lora_B "
                    f"[{fan_out}, r], got {list(w.lora_A.shape)} and {list(w.lora_B.shape)}"
                )
        used = set(self._slots.values())
        slot = next((s for s in range(1, self._capacity) if s not in used), None)
        capacity = self._capacity
        if slot is None:
            # One slot more, not double: a slot of r=16 on every layer is ~20 MB on a 135M model,
            # and the store frees slots by eviction, so the bank stops growing at its bound.
            slot, capacity = self._capacity, self._capacity + 1
        staged, created = {}, []
        try:
            for module, entry in self._modules.items():
                w = weights.get(module)
                r_max = max(entry.r_max, w.rank if w is not None else 0)
                if w is not None or capacity != self._capacity:
                    staged[module] = entry.staged(slot, w, capacity, r_max)
            for module, w in weights.items():
                if module not in self._modules:
                    entry = _ModuleLora(self, self._linear[module], capacity)
                    created.append(module)
                    self._modules[module] = entry
                    staged[module] = entry.staged(slot, w, capacity, w.rank)
        except BaseException:
            for module in created:
                self._modules.pop(module).handle.remove()
            for entry in self._modules.values():  # keep free slots all zero
                if slot < entry.A.shape[0]:
                    entry.A[slot], entry.Bt[slot] = 0, 0
            raise
        for module, stacks in staged.items():
            self._modules[module].commit(stacks)
        self._capacity = capacity
        self._slots[name] = slot
        self._last_rows = None
        return slot

    def remove(self, name: str) -> None:
        """Drop `name`'s weights; a module no resident adapter adapts loses its hook."""
        slot = self._slots.pop(name)
        self._last_rows = None  # slot contents change: no layer may reuse gathered weights
        for module in list(self._modules):
            entry = self._modules[module]
            if entry.ranks[slot]:
                entry.commit(entry.staged(slot, None, self._capacity, entry.r_max))
            if not any(entry.ranks):
                entry.handle.remove()
                del self._modules[module]
        if self.slot == slot or self.rows is not None:
            self.select(None)

    def close(self) -> None:
        """Remove every adapter and hook: the model is the bare base again."""
        for entry in self._modules.values():
            entry.handle.remove()
        self._modules.clear()
        self._slots.clear()
        self._capacity = 1
        self.select(None)

    # -- what the next forward applies -------------------------------------------------------

    def select(self, name: str | None) -> None:
        """Every row of the next forwards runs `name` (None: the base). Sets an int."""
        self.slot = 0 if name is None else self._slot_of(name)
        self.rows = None

    def select_rows(self, names: Sequence[str | None]) -> None:
        """Row i of the next forwards runs `names[i]` (None: the base). A batch on one adapter
        takes the cheaper one-adapter path."""
        slots = [0 if n is None else self._slot_of(n) for n in names]
        if not slots:
            raise ValueError("a mixed-adapter batch needs at least one row")
        if len(set(slots)) == 1:
            self.slot, self.rows = slots[0], None
            return
        if self._last_rows is None or self._last_rows[0] != slots:
            device = next(iter(self._modules.values())).A.device if self._modules else "cpu"
            self._last_rows = (slots, torch.tensor(slots, dtype=torch.long, device=device))
        # The same tensor object for the same composition: the layers keep their gathered weights.
        self.rows = self._last_rows[1]  # [batch]
        self.slot = None

    def _slot_of(self, name: str) -> int:
        slot = self._slots.get(name)
        if slot is None:
            raise KeyError(f"adapter {name!r} is not in the bank; resident: {self.names()}")
        return slot


def installed_on(model: nn.Module) -> bool:
    """Whether a `LoraBank` has hooks on `model` (reads torch's hook table, changes nothing)."""
    return any(
        isinstance(hook, _ModuleLora)
        for module in model.modules()
        for hook in module._forward_hooks.values()
    )
