"""OpenAI's error envelope: {"error": {"message", "type", "param", "code"}} with the matching status.

`code` is always a string, as OpenAI's are, so a client can branch on it without parsing the message;
`param` names the request field to change (a path such as "messages[0].role" inside it), or is null.

Codes a client may see:

| status | code | when |
| --- | --- | --- |
| 400 | invalid_type | a field's JSON type is wrong |
| 400 | invalid_value | a field's value is out of range, not one of the allowed ones, or at odds with another field |
| 400 | missing_required_parameter | a required field is absent or null |
| 400 | context_length_exceeded | prompt + max_tokens do not fit the context or the KV cache |
| 400 | invalid_json | the body is not a JSON object |
| 401 | invalid_api_key | no key, or not one of --api-key / --api-keys |
| 404 | model_not_found | `model` names a model this server does not serve |
| 404 | unknown_url | no such route |
| 405 | method_not_allowed | the route exists, the method does not |
| 413 | request_too_large | the body exceeds --max-body-bytes |
| 415 | unsupported_media_type | the body is not sent as application/json |
| 429 | rate_limit_exceeded | the waiting queue is full (Retry-After says when to retry) |
| 500 | engine_error, engine_dead, internal_error | the engine failed this request, stopped, or a bug |
| 503 | draining, shutdown | the server is shutting down (retry on another replica) |
"""

from __future__ import annotations

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    404: "unknown_url",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _CODES.get(status, "invalid_request")
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        """Anthropic's envelope: {"type": "error", "error": {"type", "message"}}."""
        kind = _ANTHROPIC_TYPES.get(
            self.status, "api_error" if self.status >= 500 else "invalid_request_error"
        )
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, style: str = "openai") -> web.Response:
        """The error in the envelope of the API the client speaks (error_style)."""
        if style == "anthropic":
            body = self.anthropic_body()
        elif style == "ollama":
            body = {"error": self.message}  # Ollama's: the message alone
        else:
            body = self.body()
        return web.json_response(body, status=self.status, headers=self.headers)


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_style(path: str) -> str:
    """Which envelope a route's errors use: Anthropic's under /v1/messages, Ollama's under /api/,
    OpenAI's elsewhere."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)
