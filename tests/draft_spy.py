"""Test helper: record every token a drafter drafts."""

from __future__ import annotations

import pytest


def drafted_tokens(monkeypatch: pytest.MonkeyPatch, drafter: object) -> list[int]:
    """The list ``drafter``'s trees' drafted tokens (root excluded) are appended to from now on,
    as the decoding loop drafts them (``draft_many``)."""
    drafted: list[int] = []
    draft_many = drafter.draft_many

    def spy(requests):
        trees = draft_many(requests)
        for tree in trees:
            drafted.extend(tree.tokens[1:].tolist())
        return trees

    monkeypatch.setattr(drafter, "draft_many", spy)
    return drafted
