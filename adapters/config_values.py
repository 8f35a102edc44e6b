"""Types and bounds of the `adapter_config.json` values that selfspec or peft compute with.

An adapter config is untrusted input: a `lora_alpha` of `"sixteen"` or `1e400`, a rank with a
thousand digits or a list where a mapping belongs would otherwise fail deep inside peft or the
fast path (a TypeError or OverflowError at load, a 500 at the server). Each value is checked here,
before peft sees the config, and a bad one is an `InvalidAdapter` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from selfspec.adapters.errors import InvalidAdapter

MAX_ALPHA = 1e6
"""Largest |lora_alpha| (alpha_pattern values included); real adapters use at most a few hundred."""
MAX_DEPTH = 16
"""Deepest nesting of lists and objects in a config file (peft's configs nest 2 or 3 levels)."""
MAX_ITEMS = 4096
"""Longest list or mapping in a module-selecting field."""
MAX_LAYER = 1 << 20


def short_repr(value: object, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters (a config value may be a 4,000-digit int)."""
    return cut(repr(value), limit)


def cut(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters, for error messages."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def check_depth(data: object, where: str) -> None:
    """Refuse JSON nested deeper than `MAX_DEPTH` (comparing or copying it could recurse)."""
    level: list[object] = [data]
    for _ in range(MAX_DEPTH + 1):
        level = [
            child
            for item in level
            if isinstance(item, (list, dict))
            for child in (item.values() if isinstance(item, dict) else item)
        ]
        if not level:
            return
    raise InvalidAdapter(f"{where} nests lists or objects deeper than {MAX_DEPTH} levels")


def check_config_values(config: Mapping[str, Any], where: str) -> None:
    """Refuse a config whose numeric or module-selecting fields have the wrong type or an absurd
    value. `where` names the adapter and its config file. Ranks are checked by the caller
    against the store's rank limit."""

    def expect(field: str, ok: bool, what: str) -> None:
        if not ok:
            raise InvalidAdapter(
                f"{where}: field {field} must be {what}, got {short_repr(config[field])}"
            )

    def get(field: str) -> Any:
        return config.get(field)

    if "r" in config:
        expect("r", _is_int(get("r")), "an int")
    if "lora_alpha" in config:
        bound = f"a number with |alpha| <= {MAX_ALPHA:g}"
        expect("lora_alpha", _is_alpha(get("lora_alpha")), bound)
    for field, value_ok, what in (
        ("rank_pattern", _is_int, "ints"),
        ("alpha_pattern", _is_alpha, f"numbers with |alpha| <= {MAX_ALPHA:g}"),
    ):
        value = get(field)
        expect(
            field,
            value is None
            or (
                isinstance(value, dict)
                and len(value) <= MAX_ITEMS
                and all(isinstance(k, str) and k and value_ok(v) for k, v in value.items())
            ),
            f"an object of module-name patterns to {what}",
        )
    if "target_modules" in config:
        expect("target_modules", _is_names(get("target_modules")), "a string or a list of strings")
    for field in ("exclude_modules", "layers_pattern"):
        expect(field, get(field) is None or _is_names(get(field)), "a string or a list of strings")
    layers = get("layers_to_transform")
    expect(
        "layers_to_transform",
        layers is None
        or _is_layer(layers)
        or (isinstance(layers, list) and len(layers) <= MAX_ITEMS and all(map(_is_layer, layers))),
        f"a layer index or a list of them (0 to {MAX_LAYER})",
    )
    if "lora_dropout" in config:
        dropout = get("lora_dropout")
        expect(
            "lora_dropout", _is_number(dropout) and 0 <= dropout <= 1, "a number from 0 to 1"
        )
    for field in ("use_rslora", "fan_in_fan_out", "inference_mode"):
        if field in config:
            expect(field, isinstance(get(field), bool), "true or false")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    # math.isfinite of a huge int overflows; an int is finite anyway.
    return isinstance(value, int) or math.isfinite(value)


def _is_alpha(value: object) -> bool:
    return _is_number(value) and abs(value) <= MAX_ALPHA  # type: ignore[arg-type]


def _is_layer(value: object) -> bool:
    return _is_int(value) and 0 <= value <= MAX_LAYER  # type: ignore[operator]


def _is_names(value: object) -> bool:
    if isinstance(value, str):
        return bool(value)
    return (
        isinstance(value, list)
        and len(value) <= MAX_ITEMS
        and all(isinstance(item, str) and item for item in value)
    )
