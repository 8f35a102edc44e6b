"""Log-probabilities in the two shapes OpenAI's API returns them.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}], "refusal": null}``. Completions: ``{"tokens", "token_logprobs", "top_logprobs":
[{token: logprob}], "text_offset"}`` (a prompt's first token, echoed, has no log-probability:
null and null). A token's text is its own decoding (a piece of a multi-byte character decodes
to U+FFFD, as in vLLM); ``bytes`` are that text's UTF-8 bytes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from selfspec.logprobs import TokenLogprob


class TokenTexts:
    """Token id -> text, decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode = lru_cache(maxsize=65536)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        )

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)

    def text_of(self, token_ids: list[int]) -> str:
        """Several tokens' text together (an echoed prompt given as token ids)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


def chat_logprobs(texts: TokenTexts, items: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**entry(item.token_id, item.logprob), "top_logprobs": [entry(*alt) for alt in item.top]}
        for item in items
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    texts: TokenTexts, items: list[TokenLogprob | None], token_ids: list[int], offset: int = 0
) -> dict[str, Any]:
    """``items[i]`` scores ``token_ids[i]`` (None: unscored, an echoed prompt's first token);
    text offsets count from ``offset`` (the characters before these tokens in the choice)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, item in zip(token_ids, items, strict=True):
        text = texts(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(None if item is None else item.logprob)
        tops.append(None if item is None else {texts(i): value for i, value in item.top})
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
