"""Parse and validate OpenAI request bodies into one typed request; every error names its field.

Validation is explicit rather than through pydantic models so each message says which field is
wrong and what was expected, in the OpenAI error shape, and so options we do not implement
(penalties, logit_bias, tools, ...) are refused by name instead of silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from selfspec.logprobs import MAX_TOP_LOGPROBS
from selfspec.serve.errors import bad_request

UNSUPPORTED: dict[str, object] = {
    # field -> the only value accepted (the OpenAI default); anything else is refused by name.
    "best_of": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "suffix": None,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
}
MAX_CHOICES = 16
"""Most choices (`n`) one request may ask for; each is its own engine request."""


@dataclass(frozen=True)
class ParsedRequest:
    """One completion request, independent of the endpoint it came from."""

    model: str
    prompt: str | list[int] | None
    """Completions: text or token ids. None for chat."""
    messages: list[dict[str, str]] | None
    """Chat: role/content messages with text content."""
    max_tokens: int | None
    """None: the endpoint's default (16 for completions, the rest of the context for chat)."""
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    speculation: bool | None
    """None: the server's default (on when it has heads)."""
    ignore_eos: bool
    n: int = 1
    """Choices: independent generations of the prompt (choice i seeded with seed + i)."""
    logprobs: int | None = None
    """None: no log-probabilities; k: each token's, with its k best alternatives (chat:
    ``logprobs: true`` + ``top_logprobs: k``; completions: ``logprobs: k``)."""
    echo: bool = False
    """Completions: the prompt is repeated before the completion (with its log-probabilities
    when they are asked for)."""

    def __post_init__(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {self.n}")


def parse_request(body: object, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name, default in UNSUPPORTED.items():
        value = body.get(name, default)
        if value not in (default, None) and not (value is False and default is None):
            raise bad_request(
                f"'{name}' is not supported by this server (got {_shown(value)}); leave it out",
                name,
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: the base model's name or an adapter's", "model")
    n = _int(body, "n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(
            f"'n' (number of choices) must be an integer in [1, {MAX_CHOICES}], got {_shown(n)}",
            "n",
        )
    prompt = None
    messages = None
    echo = False
    if chat:
        logprobs = _chat_logprobs(body)
        messages = _messages(body.get("messages"))
        max_tokens = _int(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", None)
        field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    else:
        if "top_logprobs" in body and body["top_logprobs"] is not None:
            raise bad_request(
                "'top_logprobs' is a chat option; completions take 'logprobs': <count>",
                "top_logprobs",
            )
        logprobs = _int(body, "logprobs", None)
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(
                f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {logprobs}",
                "logprobs",
            )
        echo = bool(_bool(body, "echo", False))
        prompt = _prompt(body.get("prompt"))
        max_tokens = _int(body, "max_tokens", None)
        field = "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"'{field}' must be >= 1, got {max_tokens}", field)
    temperature = _number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _int(body, "top_k", 0)
    if top_k < -1:
        raise bad_request(
            f"'top_k' must be >= 1, or 0 / -1 for no limit, got {_shown(top_k)}", "top_k"
        )
    seed = _int(body, "seed", None)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise bad_request(f"'seed' must be a 64-bit signed integer, got {_shown(seed)}", "seed")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request(
                "'stream_options' is only allowed with 'stream': true", "stream_options"
            )
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
    return ParsedRequest(
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        seed=seed,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        speculation=_bool(body, "speculation", None),
        ignore_eos=_bool(body, "ignore_eos", False),
        n=n,
        logprobs=logprobs,
        echo=echo,
    )


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs`` (bool) and ``top_logprobs`` (0..20, only with logprobs)."""
    wanted = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(
            f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {_shown(top)}",
            "top_logprobs",
        )
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _shown(value: object, limit: int = 40) -> str:
    """A value as an error message shows it: cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {_shown(value)}", name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    try:
        number = float(value) if isinstance(value, int | float) else math.nan
    except OverflowError:  # an integer beyond any float
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number):
        raise bad_request(f"'{name}' must be a finite number, got {_shown(value)}", name)
    return number


def _bool(
    body: dict[str, Any], name: str, default: bool | None, label: str | None = None
) -> bool | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        shown = label or name
        raise bad_request(f"'{shown}' must be true or false, got {_shown(value)}", shown)
    return value


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    return tuple(stops)


def _prompt(value: object) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str) and value:
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return list(value)
    raise bad_request(
        "'prompt' must be a non-empty string or a non-empty list of token ids "
        "(one prompt per request)",
        "prompt",
    )


def _messages(value: object) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'", where)
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise bad_request(f"'{where}.role' must be a non-empty string", f"{where}.role")
        if isinstance(content, list):  # content parts: only text is understood
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad_request(
                        f"'{where}.content' parts must be {{'type': 'text', 'text': ...}}",
                        f"{where}.content",
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad_request(f"'{where}.content' must be a string", f"{where}.content")
        messages.append({"role": role, "content": content})
    return messages
