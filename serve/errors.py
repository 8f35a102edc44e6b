"""OpenAI-style API errors: one exception type carrying the HTTP status and the error body.

Body: ``{"error": {"message", "type", "param", "code"}}`` as OpenAI (and vLLM) send it, so
existing clients surface our messages unchanged.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the client; ``param`` names the offending request field."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, type_="not_found_error", param=param, code="model_not_found")


def overloaded(message: str) -> APIError:
    return APIError(429, message, type_="rate_limit_error", code="queue_full")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type_="service_unavailable", code="not_serving")
