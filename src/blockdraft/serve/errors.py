"""Every refusal the server gives, as OpenAI's error object with vLLM's fields: {"error": {message, type, param,
code}}, `code` being the HTTP status as vLLM writes it. The type names are the `openai` client's exception names.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for one refusal."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


class ApiError(Exception):
    """A request the server answers with an HTTP error status; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def __reduce__(self) -> tuple[type, tuple[int, str, str | None, dict[str, str]]]:
        """Pickled with every field (it travels from the engine process inside a Failed event)."""
        return ApiError, (self.status, self.message, self.param, self.headers)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
