"""How the Ray Serve ingress hands an HTTP request to an engine replica and relays the answer.

The replica runs the single-process app (``serve.app``) unchanged on a loopback port, so every
route, validation, error shape and SSE framing is the one the single-process server has. The
ingress sends it a `ForwardedRequest` through a Ray Serve handle (which picks the replica); the
replica streams back one `ResponseStart`, then the body's bytes as they come.

`relay` is the ingress' side: it retries a request whose replica failed before answering
(nothing reached the client yet, e.g. the replica died), and ends a stream whose replica failed
mid-way with an OpenAI-style error event (SSE) so that no client hangs. Needs no Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from selfspec.serve.errors import APIError

logger = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",  # the relay re-frames the body
    }
)
"""Headers that describe one connection, not the message: never forwarded either way."""
NOT_RELAYED = frozenset({"date", "server"})
"""Response headers the ingress' own server sets."""
REPLICA_HEADER = "x-selfspec-replica"
"""Response header naming the replica (Ray Serve's replica tag) that answered."""


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    target: str
    """Path and query string, e.g. ``/v1/completions``."""
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True)
class ResponseStart:
    """The first item a replica yields: the status and headers of its answer."""

    status: int
    headers: tuple[tuple[str, str], ...]
    replica: str

    @property
    def media_type(self) -> str:
        return next((v for k, v in self.headers if k.lower() == "content-type"), "")


def end_to_end(
    headers: Iterable[tuple[str, str]], drop: frozenset[str] = frozenset()
) -> tuple[tuple[str, str], ...]:
    """``headers`` less the hop-by-hop ones (and ``drop``), names lower-cased."""
    kept = []
    for name, value in headers:
        lowered = name.lower()
        if lowered not in HOP_BY_HOP and lowered not in drop:
            kept.append((lowered, value))
    return tuple(kept)


def adapter_of(body: bytes, base_model: str | None) -> str | None:
    """The ``model`` a JSON request body names, unless it is the base model (which every
    replica holds, so it needs no affinity). None for anything else: the replica answers it."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    if not isinstance(model, str) or not model or model == base_model:
        return None
    return model


class ReplicaFailed(Exception):
    """A replica could not answer; the message says why (for logs, not for clients)."""


Call = Callable[[], AsyncIterator[object]]
"""Starts one attempt: the replica's items (a `ResponseStart`, then ``bytes``)."""
Failed = Callable[[str], None]
"""Told of each failed attempt: ``"before_answer"`` or ``"mid_response"`` (for metrics)."""


def _ignore(when: str) -> None:
    pass


async def first_answer(
    call: Call, retries: int, failed: Failed = _ignore
) -> tuple[ResponseStart, AsyncIterator[object]]:
    """The `ResponseStart` of the first attempt that gives one, with the rest of its stream.

    An attempt that fails before its `ResponseStart` is tried again (up to ``retries`` more
    times): the client has seen nothing, and a request is independent of where it runs.
    Then `APIError` 503."""
    failures: list[str] = []
    for _ in range(retries + 1):
        stream: AsyncIterator[object] | None = None
        try:
            stream = call()
            first = await anext(stream)
        except Exception as error:  # a dead actor, a failed replica: any of Ray's errors
            failures.append(f"{type(error).__name__}: {error}")
            logger.warning("an engine replica failed before answering: %s", failures[-1])
            failed("before_answer")
            if stream is not None:
                await _close(stream)
            continue
        except asyncio.CancelledError:  # the client went away: so does its request
            if stream is not None:
                await _close(stream)
            raise
        if not isinstance(first, ResponseStart):
            await _close(stream)
            raise ReplicaFailed(f"a replica answered {type(first).__name__} before its status")
        return first, stream
    raise APIError(
        503,
        f"no engine replica could answer ({len(failures)} attempt(s)); retry later",
        "service_unavailable",
        code="replica_unavailable",
    )


async def relay_body(
    start: ResponseStart, stream: AsyncIterator[object], failed: Failed = _ignore
) -> AsyncIterator[bytes]:
    """The body's bytes. A replica that fails mid-way ends an event stream with an error event
    and ``[DONE]`` (what the single-process server sends when a request fails); any other body
    raises `ReplicaFailed`, so the ingress' server aborts the response (its client sees a broken
    connection, never a truncated body that looks complete, and never a hang)."""
    try:
        async for chunk in stream:
            if isinstance(chunk, bytes):
                yield chunk
    except Exception as error:
        logger.warning("engine replica %s failed mid-response: %s", start.replica, error)
        failed("mid_response")
        if start.media_type.startswith("text/event-stream"):
            failed = APIError(
                503,
                f"the engine replica serving this request failed ({type(error).__name__}); "
                "the request did not finish",
                "service_unavailable",
                code="replica_failed",
            )
            yield f"\n\ndata: {json.dumps(failed.body())}\n\ndata: [DONE]\n\n".encode()
        else:
            raise ReplicaFailed(f"replica {start.replica} failed mid-response: {error}") from error
    finally:
        await _close(stream)


async def _close(stream: AsyncIterator[object]) -> None:
    """Stop an attempt (cancels the replica's request when it is still running)."""
    cancel = getattr(stream, "cancel", None)  # Ray's DeploymentResponseGenerator
    if callable(cancel):
        cancel()
    close = getattr(stream, "aclose", None)
    if callable(close):
        # Already failed: closing must not raise over the real error.
        with contextlib.suppress(Exception):
            await close()


__all__ = [
    "HOP_BY_HOP",
    "NOT_RELAYED",
    "REPLICA_HEADER",
    "ForwardedRequest",
    "ReplicaFailed",
    "ResponseStart",
    "adapter_of",
    "end_to_end",
    "first_answer",
    "relay_body",
]
