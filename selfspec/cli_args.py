"""Build an argparse CLI from a frozen, typed dataclass: one flag per field.

Field help comes from ``metadata["help"]``; types from the annotations (str, int, float, bool,
optional values, enums, tuples of str). The dataclass' own ``__post_init__`` validates.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        annotation = _unwrap_optional(hints[field.name])
        help_text = field.metadata.get("help", "")
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        default = (
            None
            if required
            else (
                field.default
                if field.default is not dataclasses.MISSING
                else field.default_factory()
            )
        )
        kwargs: dict[str, Any] = {"dest": field.name, "help": help_text}
        if annotation is bool:
            parser.add_argument(
                _flag(field.name), action=argparse.BooleanOptionalAction, default=default, **kwargs
            )
            continue
        if typing.get_origin(annotation) is tuple:
            kwargs.update(nargs="*", default=default, type=typing.get_args(annotation)[0])
        elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            kwargs.update(choices=[m.value for m in annotation], default=default)
        else:
            kwargs.update(type=annotation, default=default)
        if required:
            kwargs["required"] = True
        if default is not None and help_text:
            kwargs["help"] = f"{help_text} (default: {getattr(default, 'value', default)})"
        parser.add_argument(_flag(field.name), **kwargs)


def parse_dataclass(cls: type[T], argv: Sequence[str], description: str, prog: str) -> T:
    """Parse argv into ``cls``; invalid values exit with the dataclass' own error message."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_dataclass_arguments(parser, cls)
    namespace = parser.parse_args(list(argv))
    values = vars(namespace)
    for key, value in values.items():
        if isinstance(value, list):
            values[key] = tuple(value)
    try:
        return cls(**values)
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits
