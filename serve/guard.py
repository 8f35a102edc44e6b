"""Who may call the server and with what: API key, allowed hosts, JSON-only POSTs, body size.

``Guard`` is ASGI middleware around the whole app, so every route, including ones added later,
is covered, and every refusal is an OpenAI-style JSON error:

- 401 without ``Authorization: Bearer <api key>`` when a key is set (every route but ``/health``,
  and ``/metrics`` when it is public); the key is compared in constant time.
- 400 when the ``Host`` header names a host not allowed (DNS rebinding: a web page that makes a
  browser resolve its own name to 127.0.0.1 still sends its own name as Host), 403 when an
  ``Origin`` header names one.
- 415 for a POST that is not ``application/json`` (what a browser may send cross-site without
  asking first: ``text/plain``, forms).
- 413 for a body larger than ``max_body_bytes``: at once from ``Content-Length``, else as the
  body streams in (``BodyTooLarge`` raised from ``receive``, answered by the app's error handler).
- Any other exception escaping the app becomes a JSON 500 (when no response has started) and is
  logged; the connection stays usable. A client that goes away mid-body is nobody's error.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import ClientDisconnect

from selfspec.serve.errors import APIError

logger = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]

DEFAULT_MAX_BODY_BYTES = 8 << 20
"""8 MiB: a full 8k-token context as text, escaped JSON and chat framing, with room to spare."""
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class AccessPolicy:
    api_key: str | None = None
    """Required as a Bearer token on every route but /health (and /metrics when public)."""
    public_metrics: bool = False
    """/metrics answers without the key."""
    allowed_hosts: tuple[str, ...] = ("*",)
    """Host names the Host header may carry (without port); "*" allows any."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key must not be empty")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.allowed_hosts:
            raise ValueError("allowed_hosts must name at least one host (or '*')")

    @classmethod
    def for_bind_address(cls, host: str, loopback: bool, **fields: Any) -> AccessPolicy:
        """Listening on loopback only: only loopback names may appear as Host (a remote page
        cannot reach the server through a browser by rebinding its own name)."""
        hosts = LOOPBACK_HOSTS if loopback else ("*",)
        if loopback and host not in hosts:
            hosts = (*hosts, host)
        return cls(allowed_hosts=fields.pop("allowed_hosts", None) or hosts, **fields)


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"the request body exceeds this server's limit of {limit} bytes "
            "(--max-body-bytes)",
            code="request_too_large",
        )


class Guard:
    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(
        self,
        scope: Message,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            await _send_error(send, refusal)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        limit, received = self.policy.max_body_bytes, 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        try:
            await self.app(scope, limited_receive, tracked_send)
        except ClientDisconnect:
            logger.debug("client went away during %s %s", scope["method"], scope["path"])
        except Exception:
            logger.exception("unexpected error in %s %s", scope["method"], scope["path"])
            if not started:
                await _send_error(send, APIError(500, "internal server error", "server_error"))

    def refusal(self, scope: Message) -> APIError | None:
        """Why this request is refused before the app sees it, or None."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        policy = self.policy
        if not self._host_allowed(headers.get("host", "")):
            return APIError(400, "the Host header names a host this server does not answer for")
        origin = headers.get("origin")
        if origin and origin != "null" and not self._host_allowed(urlsplit(origin).netloc):
            return APIError(403, f"cross-origin requests from {origin!r} are not allowed",
                            "permission_error")
        path = scope["path"]
        exempt = path == "/health" or (path == "/metrics" and policy.public_metrics)
        if policy.api_key is not None and not exempt:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), policy.api_key.encode()
            ):
                return APIError(
                    401,
                    "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return APIError(
                    415,
                    f"POST bodies must be JSON (Content-Type: application/json), got "
                    f"{media or 'none'!r}",
                    code="unsupported_media_type",
                )
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > policy.max_body_bytes:
                return BodyTooLarge(policy.max_body_bytes)
        return None

    def _host_allowed(self, netloc: str) -> bool:
        allowed = self.policy.allowed_hosts
        if "*" in allowed:
            return True
        host = netloc.rsplit("@", 1)[-1]
        if host.startswith("["):  # [v6]:port
            host = host[1 : host.find("]")] if "]" in host else host
        elif host.count(":") == 1:
            host = host.split(":")[0]
        return host.lower() in allowed


async def _send_error(send: Callable[[Message], Awaitable[None]], error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
