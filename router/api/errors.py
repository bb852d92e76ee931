"""OpenAI-style errors: every failure a client can cause or see has a status and a JSON body."""

from __future__ import annotations

import json

from aiohttp import web


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=json.dumps(self.body()), content_type="application/json",
                            headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, code: str | None = None) -> APIError:
    return APIError(404, message, code=code)


def priority_shed(message: str, retry_after_s: int = 1) -> APIError:
    """429: this request's priority band is shed — more important work holds the fleet."""
    return APIError(429, message, type_="rate_limit_error", code="priority_shed", param="priority",
                    headers={"Retry-After": str(retry_after_s)})


def no_capacity(message: str, retry_after_s: int = 1) -> APIError:
    """503: the fleet is full (not the caller's quota, not its priority)."""
    return APIError(503, message, type_="service_unavailable", code="no_capacity",
                    headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str) -> APIError:
    return APIError(503, message, type_="service_unavailable", code="no_healthy_workers",
                    headers={"Retry-After": "1"})


def upstream_failed(message: str) -> APIError:
    return APIError(502, message, type_="upstream_error", code="worker_failed")
