"""Regular expressions that an adapter config hands to peft, checked before anything runs them.

peft reads some config values as regular expressions and matches them against module names:
`target_modules` / `exclude_modules` given as a string (`re.fullmatch`), the keys of
`rank_pattern` / `alpha_pattern` (`re.match(rf"(.*\\.)?({key})$", name)`) and `layers_pattern`
(`re.match(rf"(?:^|.*?\\.){pattern}\\.(?P<idx>\\d+)\\.", name)`). Python's `re` backtracks, so
a config is a way to make the server spin: `(.*)(.*)(.*)(.*)(.*)(.*)X` takes seconds per name.

So every regex peft would build from a config is parsed (never run) and refused when it is longer
than `MAX_PATTERN_CHARS`, does not compile, repeats a group that holds a quantifier or an
alternation (`(a+)+`, `(a|ab)*`), uses a backreference or a conditional, or could try more than
`MAX_PATHS` backtracking paths on a module name of `NAME_CHARS` characters. Plain patterns such as
`.*\\.(q_proj|v_proj)` or `model\\.layers\\.\\d+\\.self_attn\\.(q|v)_proj` pass.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

from selfspec.adapters.errors import InvalidAdapter

try:
    from re import _parser as _sre  # Python >= 3.11
except ImportError:  # pragma: no cover -- Python 3.10
    import sre_parse as _sre  # type: ignore[no-redef]

MAX_PATTERN_CHARS = 256
"""Longest regex accepted in a config field (module names are far shorter)."""
MAX_PATTERNS = 1024
"""Most regexes one config may hold (pattern keys included)."""
NAME_CHARS = 64
"""Module-name length assumed when bounding backtracking."""
MAX_PATHS = 100_000
"""Most backtracking paths per module name: allows three `.*` and a two-way alternation
(peft's own example `.*decoder.*(SelfAttention|EncDecAttention).*(q|v)$`), refuses four `.*`."""
_SHORT_SPAN = 8  # a repeat over at most this many lengths multiplies the paths by span + 1

_REPEATS = frozenset(
    op
    for op in (getattr(_sre, n, None) for n in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"))
    if op is not None
)
_REFUSED = {_sre.GROUPREF: "a backreference", _sre.GROUPREF_EXISTS: "a conditional group"}


def check_config_patterns(config: Mapping[str, Any], where: str) -> None:
    """Refuse `config` (types already checked) if a regex peft builds from it is unsafe.
    `where` names the adapter and its config file."""
    regexes = list(_regexes(config))
    if len(regexes) > MAX_PATTERNS:
        raise InvalidAdapter(
            f"{where}: holds {len(regexes)} regular expressions, more than {MAX_PATTERNS}"
        )
    for field, value, regex in regexes:
        check_regex(regex, where, field, value)


def check_regex(regex: str, where: str, field: str, value: str) -> None:
    """Refuse `regex` (what peft runs for the config `field` holding `value`) with an
    `InvalidAdapter` naming both, unless it is short, valid and cannot backtrack badly."""
    shown = value if len(value) <= 80 else value[:77] + "..."

    def refuse(why: str) -> InvalidAdapter:
        return InvalidAdapter(
            f"{where}: {field} {shown!r} is refused as a regular expression: {why}"
        )

    if len(value) > MAX_PATTERN_CHARS:
        raise refuse(f"{len(value)} characters, more than {MAX_PATTERN_CHARS}")
    try:
        re.compile(regex)
        parsed = _sre.parse(regex)
    except (re.error, RecursionError, OverflowError) as error:
        raise refuse(f"it is not a valid regular expression ({error})") from None
    wide, factor = 0, 1  # repeats over many lengths; product of the other choices
    for op, av, repeated in _walk(parsed, repeated=False):
        if op in _REFUSED:
            raise refuse(f"it uses {_REFUSED[op]}")
        choices = _choices(op, av)
        if choices == 1:
            continue
        if repeated:
            raise refuse(
                "it repeats a group holding a quantifier or an alternation, which can backtrack "
                "exponentially"
            )
        if op in _REPEATS and choices > _SHORT_SPAN + 1:
            wide += 1
        else:
            factor *= choices
    paths = factor * math.comb(NAME_CHARS + wide, wide)
    if paths > MAX_PATHS:
        raise refuse(
            f"it may try ~{paths:.1e} backtracking paths per module name (limit {MAX_PATHS:.0e}); "
            "use fewer '*' / '+' / alternations, or list the module names"
        )


def _regexes(config: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(field, value, the regex peft builds from it) for every regex in `config`."""
    for field in ("target_modules", "exclude_modules"):
        value = config.get(field)
        if isinstance(value, str) and value != "all-linear":
            yield field, value, value
    for field in ("rank_pattern", "alpha_pattern"):
        for key in config.get(field) or {}:
            yield f"{field} key", key, rf"(.*\.)?({key})$"
    layers = config.get("layers_pattern") or []
    for pattern in [layers] if isinstance(layers, str) else layers:
        yield "layers_pattern", pattern, rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."


def _choices(op: Any, av: Any) -> int:
    """How many ways one node may match, as far as backtracking goes (1: one way)."""
    if op in _REPEATS:
        low, high = av[0], min(av[1], NAME_CHARS)
        return max(0, high - low) + 1
    if op is _sre.BRANCH:
        return len(av[1])
    return 1


def _walk(items: Any, repeated: bool) -> Iterator[tuple[Any, Any, bool]]:
    """Every node of a parsed regex with whether it sits inside a group repeated more than once."""
    for op, av in items:
        yield op, av, repeated
        if op in _REPEATS:
            yield from _walk(av[2], repeated or av[1] > 1)
        elif op is _sre.BRANCH:
            for alternative in av[1]:
                yield from _walk(alternative, repeated)
        elif op is _sre.SUBPATTERN:
            yield from _walk(av[-1], repeated)
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            yield from _walk(av[1], repeated)
        elif op is getattr(_sre, "ATOMIC_GROUP", None):
            yield from _walk(av, repeated)
