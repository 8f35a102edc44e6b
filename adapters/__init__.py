"""LoRA adapter store, validation and hot-swap (selfspec.adapters).

One base model, many peft LoRA adapters, one set of draft heads. `AdapterStore` validates
adapters before reading a weight (`validate.py`), keeps a bounded LRU set of them resident, and
gives each request a step scope that makes its adapter the active one (`store.scope(name)`, passed
to `SpeculativeGenerator.stream(..., scope=...)`). `selfspec eval` measures how much speculation
each adapter keeps (`robustness.py`). peft is imported only when an adapter is validated or loaded.
"""

from selfspec.adapters.errors import (
    AdapterError,
    AdapterPathError,
    CorruptAdapter,
    IncompatibleAdapter,
    InvalidAdapter,
    PickleAdapter,
    RankTooHigh,
    ReservedAdapterName,
    StoreFull,
    UnknownAdapter,
    UnsafeAdapterName,
)
from selfspec.adapters.store import AdapterStore, StoreConfig
from selfspec.adapters.validate import AdapterInfo, AdapterLimits, validate_adapter

__all__ = [
    "AdapterError",
    "AdapterInfo",
    "AdapterLimits",
    "AdapterPathError",
    "AdapterStore",
    "CorruptAdapter",
    "IncompatibleAdapter",
    "InvalidAdapter",
    "PickleAdapter",
    "RankTooHigh",
    "ReservedAdapterName",
    "StoreConfig",
    "StoreFull",
    "UnknownAdapter",
    "UnsafeAdapterName",
    "validate_adapter",
]
