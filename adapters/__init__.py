"""LoRA adapter store, validation and hot-swap (selfspec.adapters)."""
