"""User turns written by the target (Magpie): the chat template opened at a user turn, an opener.

``user_turn_prompt`` renders the conversation so far plus a user turn whose content is a
sentinel, keeps the text before the sentinel (the template's frame of a user turn, whatever
the template) and appends the opener; the target continues it. ``user_message`` turns what the
target wrote back into a message, or None when nothing usable came out.
"""

from __future__ import annotations

import re

from selfspec.train.datagen.batch_decoder import GenerationResult

SENTINEL = "\u2063SELFSPEC_USER_TURN\u2063"
_SENTENCE_ENDS = ("?", ".", "!", '"', "\n")


def user_turn_prompt(tokenizer, history: list[dict[str, str]], opener: str) -> tuple[int, ...]:
    """Token ids of the chat template opened at a user turn after ``history``, then ``opener``
    (trailing spaces dropped: the target's next token carries its own leading space)."""
    rendered = tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": SENTINEL}],
        tokenize=False,
        add_generation_prompt=False,
    )
    prefix = rendered[: rendered.index(SENTINEL)] + opener.rstrip(" ")
    return tuple(tokenizer.encode(prefix, add_special_tokens=False))


def user_message(tokenizer, opener: str, result: GenerationResult | None) -> str | None:
    """The opener and the target's continuation, which ends the turn or, cut at the token limit,
    is trimmed to its last sentence or line end. None when no word of two letters or more
    remains."""
    if result is None:
        return None
    tokens = list(result.response[:-1] if result.finished else result.response)
    continuation = tokenizer.decode(tokens, skip_special_tokens=True)
    if not result.finished:
        end = max(continuation.rfind(mark) for mark in _SENTENCE_ENDS)
        continuation = continuation[: end + 1] if end >= 0 else ""
    if not re.search(r"\w\w", continuation):
        return None
    return (opener.rstrip(" ") + continuation).strip()
