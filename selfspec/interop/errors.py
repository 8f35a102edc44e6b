"""The one error of format conversion: the input names what is wrong and what was expected."""

from __future__ import annotations


class InteropError(ValueError):
    """A checkpoint in another format that is missing, malformed, or has no selfspec
    counterpart (or selfspec heads that have none in the requested format)."""
