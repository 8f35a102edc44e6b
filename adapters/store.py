"""The adapter store: known adapters, a bounded resident set, and per-request activation.

One base model, many LoRA adapters. Adapters are *known* (validated from their config and
safetensors header, see `validate.py`) when registered, and *resident* (weights in memory, ready
to apply) when loaded: on demand, or explicitly. The resident set is bounded in count and in
bytes; the least recently used unpinned adapter is evicted to make room.

How resident adapters are applied (`StoreConfig.backend`): by default the fast path
(`fast_lora.LoraBank`: every resident adapter's weights stacked per base linear layer, added by
forward hooks; a switch sets an int). An adapter the bank cannot represent exactly falls back to
peft's own LoRA layers, with a warning naming it and the reason (`fallbacks`, `fallback_loads`,
`backend_of`). `backend=peft` puts every adapter on peft. The files are read and validated the
same way either way (peft's format: `adapter_config.json` + `adapter_model.safetensors`).

Activation is per step: `store.scope(name)` gives the zero-argument context factory that
`SpeculativeGenerator.stream(..., scope=...)` enters around every step of a request, so requests on
different adapters can be interleaved step by step. Switching copies no weight (the bank's slot;
for peft adapters `set_adapter` flips which LoRA branch each layer runs); `None` is the base model.
Steps hold the store's lock, so threads never see each other's activation. Validation (config,
patterns, safetensors header) and reading an adapter's weights run outside the lock unless the
caller already holds it, so a slow or hostile adapter directory never stalls running requests.

Both paths act on the base model's own modules in place (hooks on its linear layers; peft's
layers wrap them), so a `SpeculativeGenerator` built on the base model (before or after any load)
runs the adapted modules: build it on `store.base_model`.

Every operation either succeeds or raises an `AdapterError` and leaves the store as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import PreTrainedModel

from selfspec.adapters import fast_lora
from selfspec.adapters.errors import (
    AdapterError,
    AdapterPathError,
    CorruptAdapter,
    InvalidAdapter,
    ReservedAdapterName,
    StoreFull,
    UnknownAdapter,
)
from selfspec.adapters.validate import (
    AdapterInfo,
    AdapterLimits,
    BaseLayout,
    check_name,
    validate_adapter,
)
from selfspec.fingerprint import fingerprint_of

logger = logging.getLogger(__name__)

StepScope = Callable[[], contextlib.AbstractContextManager]
_UNSET = object()  # activation state unknown (after a load or unload): re-apply on next step
BASE_ADAPTER_NAME = "__base__"
"""peft's name for "no adapter" in a mixed-adapter batch (`adapter_names`)."""


class LoraBackend(str, Enum):
    """How resident adapters are applied to the base's forward."""

    FAST = "fast"
    """`fast_lora.LoraBank`: stacked weights, forward hooks, a switch sets an int. Adapters it
    cannot represent exactly fall back to peft, with a warning (`AdapterStore.fallbacks`)."""
    PEFT = "peft"
    """peft's own LoRA layers for every adapter (`set_adapter`, `adapter_names`)."""


@dataclass(frozen=True)
class StoreConfig:
    """Bounds of the resident set and limits on what may be registered."""

    max_resident: int = 8
    """Most adapters resident at once."""
    max_bytes: int = 1 << 30
    """Most bytes of resident LoRA weights (in the base dtype). A load may exceed it by one
    adapter while the new weights are injected, before the evicted ones are dropped."""
    limits: AdapterLimits = field(default_factory=AdapterLimits)
    """Rank and file-size limits every adapter is validated against."""
    backend: LoraBackend = LoraBackend.FAST
    """How adapters are applied: the fast path (default) or peft's layers."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "backend", LoraBackend(self.backend))
        except ValueError:
            choices = ", ".join(repr(b.value) for b in LoraBackend)
            raise ValueError(f"backend must be one of {choices}, got {self.backend!r}") from None
        if self.max_resident < 1:
            raise ValueError(f"max_resident must be >= 1, got {self.max_resident}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")


class AdapterStore:
    """Known and resident LoRA adapters of one base model.

    `root`: every valid subdirectory is registered under its directory name (invalid ones are
    listed in `rejected` with the reason); with a root, every adapter path must lie inside it.
    `adapters`: explicit name -> directory pairs.
    `base_name`: the name clients use for the base model itself (e.g. the served model id); no
    adapter may be registered under it. None: no name is reserved.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        root: str | Path | None = None,
        adapters: Mapping[str, str | Path] | None = None,
        config: StoreConfig | None = None,
        base_name: str | None = None,
    ) -> None:
        if (
            callable(getattr(model, "get_base_model", None))
            or any(hasattr(module, "base_layer") for module in model.modules())
            or fast_lora.installed_on(model)
        ):
            raise TypeError(
                "AdapterStore takes the plain base model; this one is peft-wrapped or already "
                "carries LoRA layers (one store per base model)"
            )
        self.base_model = model
        self.base_name = base_name
        self.config = config or StoreConfig()
        self.root = Path(root).expanduser().resolve() if root is not None else None
        if self.root is not None and not self.root.is_dir():
            raise AdapterPathError(f"adapters root {str(root)!r} is not an existing directory")
        self.layout = BaseLayout.of(model, fingerprint_of(model))
        self.rejected: dict[str, str] = {}
        """Subdirectories of the root that `scan` could not register -> why (an entry goes when
        an adapter is registered under that name)."""
        self._known: dict[str, AdapterInfo] = {}
        self._resident: OrderedDict[str, AdapterInfo] = OrderedDict()  # least recent first
        # Our name -> peft's. peft names are "slot<N>": a user name may hold '.', which a torch
        # ModuleDict key cannot, or be a substring of peft's "lora_" prefix, which breaks loading.
        self._peft_names: dict[str, str] = {}
        self._loads = 0
        self._pins: Counter[str] = Counter()
        self._peft: Any = None  # peft.PeftModel, created with the first peft load
        self._peft_active: object = None  # what peft's layers run: name, None (base) or _UNSET
        self._layers: list[Any] = []  # peft's LoRA layers, cached when `_peft_active` was _UNSET
        self._bank = fast_lora.LoraBank(model)  # hooks only once an adapter is in it
        self._fallbacks: dict[str, str] = {}
        self._fallback_loads = 0
        self._lock = threading.RLock()
        if self.root is not None:
            self.scan()
        for name, path in (adapters or {}).items():
            self.register(name, path)

    # -- what is known -----------------------------------------------------------------------

    def scan(self) -> list[str]:
        """Register every valid adapter directory under the root; returns the new names.

        One bad folder never stops the scan, whatever is wrong with it: it is recorded in
        `rejected` (directory name -> why) and the others are registered."""
        if self.root is None:
            raise AdapterPathError("this store has no adapters root to scan")
        try:
            children = sorted(self.root.iterdir())
        except OSError as error:
            raise AdapterPathError(
                f"adapters root {self.root.name!r} cannot be listed: {error.strerror}"
            ) from error
        added = []
        for child in children:
            try:
                if child.name.startswith(".") or not child.is_dir() or child.name in self._known:
                    continue
                self.register(child.name, child)
            except AdapterError as error:
                self.rejected[child.name] = str(error)
                logger.warning("skipping adapter folder %r: %s", child.name, error)
            # A backstop: validation turns every expected failure into an AdapterError, but a
            # server must still start when some folder trips something unforeseen.
            except Exception as error:
                self.rejected[child.name] = f"unexpected {type(error).__name__}: {error}"
                logger.exception("skipping adapter folder %r", child.name)
            else:
                added.append(child.name)
        return added

    def register(self, name: str, path: str | Path) -> AdapterInfo:
        """Validate the adapter at `path` and know it as `name`. Reads no weight.

        Validation runs outside the store's lock. A failure leaves the name free; the base
        model's name (`base_name`) is refused."""
        check_name(name)
        if self.base_name is not None and name == self.base_name:
            raise ReservedAdapterName(
                f"adapter name {name!r} is the base model's name; choose another name"
            )
        info = validate_adapter(name, path, self.layout, self.config.limits, self.root)
        with self._lock:
            known = self._known.get(name)
            if known is not None and known.path != info.path:
                raise AdapterError(
                    f"adapter name {name!r} is already registered for {known.display_path}; "
                    f"not re-registering it for {info.display_path}"
                )
            self._known.setdefault(name, info)
            self.rejected.pop(name, None)
            return self._known[name]

    def resolve(self, name_or_dir: str) -> str:
        """A registered name as is; an adapter directory (under the root, if the store has one)
        is registered under its directory name."""
        with self._lock:
            if name_or_dir in self._known:
                return name_or_dir
        given = Path(name_or_dir).expanduser()
        candidates = [given]
        if self.root is not None and not given.is_absolute():
            candidates.insert(0, self.root / given)
        for candidate in candidates:
            if candidate.is_dir():
                name = Path(os.path.abspath(candidate)).name
                return self.register(name, candidate).name
        with self._lock:
            raise UnknownAdapter(
                f"unknown adapter {name_or_dir!r}: not a registered name and not an adapter "
                f"directory; known adapters: {', '.join(self.names()) or '(none)'}"
            )

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._known))

    def info(self, name: str) -> AdapterInfo:
        return self._get(name)

    # -- what is resident --------------------------------------------------------------------

    def resident(self) -> tuple[str, ...]:
        """Resident adapters, least recently used first."""
        with self._lock:
            return tuple(self._resident)

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(info.nbytes for info in self._resident.values())

    @property
    def lora_bytes(self) -> int:
        """Bytes of LoRA weights held now: the fast path's stacks (free slots and rank padding
        included) plus peft's LoRA parameters. `resident_bytes` counts unpadded weights."""
        with self._lock:
            peft = 0
            if self._peft is not None:
                peft = sum(p.nbytes for n, p in self._peft.named_parameters() if "lora_" in n)
            return self._bank.nbytes + peft

    def backend_of(self, name: str) -> LoraBackend | None:
        """How the resident adapter `name` is applied; None when it is not resident."""
        with self._lock:
            self._get(name)
            if name in self._bank:
                return LoraBackend.FAST
            return LoraBackend.PEFT if name in self._peft_names else None

    @property
    def fallbacks(self) -> dict[str, str]:
        """Adapters that the fast path could not apply, so peft does -> why (latest load)."""
        with self._lock:
            return dict(self._fallbacks)

    @property
    def fallback_loads(self) -> int:
        """How many loads fell back from the fast path to peft (a counter for metrics)."""
        return self._fallback_loads

    def load(self, name: str) -> AdapterInfo:
        """Make `name` resident (evicting least recently used adapters if needed) and most
        recently used. A resident adapter is only marked used.

        The files are validated again and the weights read before the store's lock is taken
        (unless the caller holds it): only the swap into the resident set runs under it."""
        with self._lock:
            info = self._get(name)
            if name in self._resident:
                self._resident.move_to_end(name)
                return info
            self._victims_for(info)  # a full store is refused before anything is read
        fresh = validate_adapter(name, info.path, self.layout, self.config.limits, self.root)
        # Outside inference mode even when loaded on demand inside a generation step: inference
        # tensors would break peft's later requires_grad bookkeeping.
        with torch.inference_mode(False):
            state = _read_weights(fresh, self.base_model.get_input_embeddings().weight)
        with self._lock:
            if name in self._resident:  # another thread loaded it meanwhile
                self._resident.move_to_end(name)
                return self._resident[name]
            return self._install(fresh, state)

    def unload(self, name: str) -> bool:
        """Drop `name`'s weights; False if it was not resident. A pinned adapter is refused."""
        with self._lock:
            self._get(name)
            if name not in self._resident:
                return False
            if self._pins[name]:
                raise AdapterError(f"adapter {name!r} is pinned by a running request; not unloaded")
            self._evict(name)
            return True

    def forget(self, name: str) -> None:
        """Unload `name` and free the name: a later `register` may give it another directory
        (an operator replacing an adapter under its name). A pinned adapter is refused."""
        with self._lock:
            self.unload(name)  # unknown or pinned: refused there (the lock is reentrant)
            del self._known[name]
            self._pins.pop(name, None)

    @contextlib.contextmanager
    def pinned(self, name: str | None) -> Iterator[None]:
        """Keep `name` resident (never evicted) for the duration, e.g. of one request."""
        if name is None:
            yield
            return
        self.load(name)  # validation and reading outside the lock
        with self._lock:
            self.load(name)  # only marks it used, unless it was evicted meanwhile
            self._pins[name] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[name] -= 1
                if not self._pins[name]:
                    del self._pins[name]

    # -- activation --------------------------------------------------------------------------

    def scope(self, name: str | None) -> StepScope:
        """Context factory for `SpeculativeGenerator.stream(..., scope=...)`: each step runs with
        `name` active (None: the base model), loading it again if it was evicted meanwhile.

        An unknown name fails here, before the request starts (never a fallback to the base)."""
        if name is not None:
            self._get(name)

        @contextlib.contextmanager
        def step() -> Iterator[None]:
            if name is not None:
                self.load(name)  # an evicted adapter is read again outside the lock
            with self._lock:
                if name is not None:
                    self.load(name)
                self._activate(name)
                yield

        return step

    @contextlib.contextmanager
    def batch_scope(self, names: Sequence[str | None]) -> Iterator[list[str]]:
        """Mixed-adapter batch: row i of a forward run inside uses adapter `names[i]` (None: the
        base). All named adapters are resident and pinned for the duration. Yields each row's
        label (its adapter's name, `BASE_ADAPTER_NAME` for the base). Works for any forward of
        the base model's modules, including the decoder body the generator runs.

        Fast-path adapters run through the bank's per-row indices; peft-fallback adapters through
        peft's `adapter_names` hooks. One batch mixing the two is refused with an `AdapterError`
        (run them as separate batches): each path applies only its own adapters."""
        rows = list(names)
        distinct = sorted({n for n in rows if n is not None})
        labels = [BASE_ADAPTER_NAME if n is None else n for n in rows]
        with contextlib.ExitStack() as stack:
            for name in distinct:
                stack.enter_context(self.pinned(name))
            stack.enter_context(self._lock)
            on_peft = [n for n in distinct if n in self._peft_names]
            if on_peft and len(on_peft) < len(distinct):
                on_fast = [n for n in distinct if n not in self._peft_names]
                raise AdapterError(
                    f"one batch cannot mix fast-path adapters ({', '.join(on_fast)}) with adapters "
                    f"that fell back to peft ({', '.join(on_peft)}); run them as separate batches"
                )
            stack.callback(self._bank.select, None)  # the next step scope selects its own
            if not on_peft:
                self._activate_peft(None)
                self._bank.select_rows(rows)
                yield labels
                return
            self._bank.select(None)
            self._activate_peft(on_peft[0])  # peft runs the hooks only while an adapter is enabled
            peft_names = [BASE_ADAPTER_NAME if n is None else self._peft_names[n] for n in rows]
            stack.enter_context(self._peft._enable_peft_forward_hooks(adapter_names=peft_names))
            yield labels

    # -- internals ---------------------------------------------------------------------------

    def _get(self, name: str) -> AdapterInfo:
        info = self._known.get(name) if isinstance(name, str) else None
        if info is None:
            raise UnknownAdapter(
                f"unknown adapter {name!r}; known adapters: {', '.join(self.names()) or '(none)'}"
            )
        return info

    def _install(self, fresh: AdapterInfo, state: dict[str, torch.Tensor]) -> AdapterInfo:
        """Put validated weights into the resident set, evicting as needed. Under the lock."""
        name = fresh.name
        victims = self._victims_for(fresh)
        reason = self._fast_refusal(fresh)
        if reason is None:
            self._bank_add(fresh, state)
        else:
            self._loads += 1
            peft_name = f"slot{self._loads}"
            self._inject(fresh, peft_name, state)
            self._peft_names[name] = peft_name
            self._peft_active = _UNSET
            if self.config.backend is LoraBackend.FAST:
                self._fallback_loads += 1
                self._fallbacks[name] = reason
                logger.warning("adapter %r runs on peft, not the fast path: %s", name, reason)
        for victim in victims:
            self._evict(victim)
        self._known[name] = fresh
        self._resident[name] = fresh
        return fresh

    def _victims_for(self, info: AdapterInfo) -> list[str]:
        """Least recently used unpinned adapters to evict so that `info` fits the bounds."""
        if info.nbytes > self.config.max_bytes:
            raise StoreFull(
                f"adapter {info.name!r} needs {info.nbytes} bytes, more than the store's "
                f"max_bytes={self.config.max_bytes}"
            )
        count, used = len(self._resident) + 1, self.resident_bytes + info.nbytes
        victims = []
        for name, resident in self._resident.items():
            if count <= self.config.max_resident and used <= self.config.max_bytes:
                break
            if self._pins[name]:
                continue
            victims.append(name)
            count, used = count - 1, used - resident.nbytes
        if count > self.config.max_resident or used > self.config.max_bytes:
            raise StoreFull(
                f"cannot load adapter {info.name!r}: the resident set is full of pinned adapters "
                f"({', '.join(self._resident)}); max_resident={self.config.max_resident}, "
                f"max_bytes={self.config.max_bytes}"
            )
        return victims

    def _inject(self, info: AdapterInfo, peft_name: str, state: dict[str, torch.Tensor]) -> None:
        """Add `info`'s LoRA branch to the base and set its weights; undone on any failure."""
        from peft import LoraConfig, PeftModel
        from peft.utils import set_peft_model_state_dict

        # inference_mode freezes the branch; dropout is an identity at inference anyway; no
        # initialisation is run (the weights come from the file, and validation refused any
        # initialisation that would touch the base).
        overrides = {"inference_mode": True, "lora_dropout": 0.0, "init_lora_weights": False}
        config = LoraConfig(**{**info.config, **overrides})
        created = False
        with torch.inference_mode(False), torch.no_grad():
            try:
                if self._peft is None:
                    self._peft = PeftModel(
                        self.base_model,
                        config,
                        adapter_name=peft_name,
                        autocast_adapter_dtype=False,
                        low_cpu_mem_usage=True,
                    )
                else:
                    self._peft.add_adapter(
                        peft_name, config, low_cpu_mem_usage=True, autocast_adapter_dtype=False
                    )
                created = True
                set_peft_model_state_dict(
                    self._peft, state, adapter_name=peft_name, low_cpu_mem_usage=True
                )
                _check_injected(self._peft, peft_name, len(info.modules))
                self._peft.eval()
            except (RuntimeError, ValueError, KeyError, TypeError) as error:
                if created:
                    self._peft.delete_adapter(peft_name)
                self._peft_active = _UNSET
                raise InvalidAdapter(
                    f"adapter {info.name!r} ({info.display_path}) could not be injected: {error}"
                ) from error

    def _fast_refusal(self, info: AdapterInfo) -> str | None:
        """Why `info` goes to peft rather than the fast path; None: the fast path takes it."""
        if self.config.backend is LoraBackend.PEFT:
            return "the store's backend is peft"
        return fast_lora.unsupported_reason(info.config, info.modules, self._bank.linear_names)

    def _bank_add(self, info: AdapterInfo, state: dict[str, torch.Tensor]) -> None:
        """Put `info`'s weights in the bank; the bank is unchanged on failure."""
        try:
            weights = fast_lora.weights_from_state(state, info.config)
            if set(weights) != set(info.modules):
                raise ValueError(
                    f"the weights adapt {len(weights)} modules, validation expected "
                    f"{len(info.modules)}"
                )
            with torch.inference_mode(False), torch.no_grad():
                self._bank.add(info.name, weights)
        except ValueError as error:
            raise InvalidAdapter(
                f"adapter {info.name!r} ({info.display_path}) could not be loaded: {error}"
            ) from error

    def _evict(self, name: str) -> None:
        if name in self._bank:
            self._bank.remove(name)
        else:
            with warnings.catch_warnings():
                # peft warns that it activates another adapter; `_activate` re-applies ours anyway.
                warnings.simplefilter("ignore", UserWarning)
                self._peft.delete_adapter(self._peft_names.pop(name))
            self._peft_active = _UNSET
        self._fallbacks.pop(name, None)
        del self._resident[name]

    def _activate(self, name: str | None) -> None:
        """Make `name` (None: the base) the adapter the next forwards run: the bank's slot for a
        fast-path adapter (an int; peft's layers, if any, off), else peft's layers."""
        fast = name is not None and name in self._bank
        self._bank.select(name if fast else None)
        self._activate_peft(None if fast else name)

    def _activate_peft(self, name: str | None) -> None:
        """Make `name` (None: the base) the adapter every peft LoRA layer runs.

        After a load or unload (state `_UNSET`) this goes through peft's own model-wide calls,
        which walk every module; between resident adapters it only flips the LoRA layers it
        cached then (peft's per-layer `set_adapter` / `enable_adapters`): ~100x cheaper on the
        default model. No auxiliary peft modules exist (validation refuses modules_to_save and
        trainable tokens), so the LoRA layers are all there is to switch."""
        previous = self._peft_active
        if previous is not _UNSET and previous == name:
            return
        if self._peft is None:
            self._peft_active = name
            return
        if previous is _UNSET:
            from peft.tuners.tuners_utils import BaseTunerLayer

            tuner = self._peft.base_model
            if name is None:
                tuner.disable_adapter_layers()
            else:
                tuner.enable_adapter_layers()
                self._peft.set_adapter(self._peft_names[name], inference_mode=True)
            self._layers = [m for m in self._peft.modules() if isinstance(m, BaseTunerLayer)]
        elif name is None:
            for layer in self._layers:
                layer.enable_adapters(False)
        else:
            peft_name = self._peft_names[name]
            for layer in self._layers:
                if previous is None:
                    layer.enable_adapters(True)
                layer.set_adapter(peft_name, inference_mode=True)
            self._peft.base_model.active_adapter = peft_name  # what peft's set_adapter records
            self._peft.active_adapter = peft_name
        self._peft_active = name


def _read_weights(info: AdapterInfo, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """The adapter's tensors in the dtype and on the device of ``like`` (the base model's
    embedding weight); non-finite values are refused."""
    try:
        state = load_file(str(info.weights_path))
    except OSError as error:
        raise CorruptAdapter(
            f"adapter {info.name!r}: cannot read {info.display_path}/{info.weights_path.name}: "
            f"{error.strerror or error}"
        ) from error
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise CorruptAdapter(
            f"adapter {info.name!r}: cannot read {info.display_path}/{info.weights_path.name}: "
            f"{error}"
        ) from error
    for key, tensor in state.items():
        if not torch.isfinite(tensor).all():
            raise CorruptAdapter(f"adapter {info.name!r}: tensor {key!r} holds NaN or inf values")
    return {key: tensor.to(like.device, like.dtype) for key, tensor in state.items()}


def _check_injected(peft_model: Any, peft_name: str, num_modules: int) -> None:
    """Every LoRA parameter of the new adapter got real weights (none left on the meta device)."""
    suffixes = (f".lora_A.{peft_name}.weight", f".lora_B.{peft_name}.weight")
    params = [(n, p) for n, p in peft_model.named_parameters() if n.endswith(suffixes)]
    if len(params) != 2 * num_modules:
        raise ValueError(f"expected {2 * num_modules} LoRA tensors, peft made {len(params)}")
    empty = [n for n, p in params if p.is_meta]
    if empty:
        raise ValueError(f"no weights were loaded for {empty[:3]}")
