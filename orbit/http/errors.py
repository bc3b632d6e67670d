"""OpenAI-shaped HTTP errors: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise a subclass of `ApiError`; `install_error_handlers` turns those, FastAPI's own
validation and routing errors and any unexpected exception into that shape. Bad input is always a
400 (never FastAPI's 422), and messages never carry tracebacks or object addresses.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# Seconds a client should wait before retrying a 503.
RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    status_code = 500
    error_type = "server_error"
    default_code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)


class BadRequest(ApiError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationFailed(ApiError):
    status_code = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class NotFound(ApiError):
    status_code = 404
    error_type = "invalid_request_error"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class PayloadTooLarge(ApiError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class RequestTimeout(ApiError):
    status_code = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class UnsupportedMediaType(ApiError):
    status_code = 415
    error_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class InternalError(ApiError):
    status_code = 500
    error_type = "server_error"
    default_code = "internal_error"


class ServiceUnavailable(ApiError):
    status_code = 503
    error_type = "server_error"
    default_code = "service_unavailable"


class TooManyRequests(ApiError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "server_overloaded"


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status_code in (429, 503) else {}
    if err.status_code == 408:  # the rest of the body may still be on its way: do not reuse
        headers["Connection"] = "close"
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers or None)


def context_length_error(
    max_seq_len: int, num_prompt_tokens: int, param: str, *, at_least: bool = False
) -> BadRequest:
    """The prompt alone leaves no room for a single generated token (vLLM's wording). With
    `at_least`, the count is a lower bound from the text's length (the text was not tokenized)."""
    count = f"at least {num_prompt_tokens}" if at_least else str(num_prompt_tokens)
    return BadRequest(
        f"This model's maximum context length is {max_seq_len} tokens. However, your request "
        f"has {count} input tokens. Please reduce the length of the input messages.",
        param=param,
    )


def max_tokens_error(
    max_tokens: int, max_seq_len: int, num_prompt_tokens: int, param: str
) -> BadRequest:
    """Prompt plus max_tokens exceeds the context (vLLM's wording, which clients match)."""
    return BadRequest(
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
        f"maximum context length is {max_seq_len} tokens and your request has "
        f"{num_prompt_tokens} input tokens ({max_tokens} > {max_seq_len} - {num_prompt_tokens}).",
        param=param,
    )


def from_validation_error(exc: ValidationError | RequestValidationError) -> BadRequest:
    """The first pydantic error as a 400 naming the offending field."""
    first = exc.errors()[0]
    path, in_union = _loc_to_param(first.get("loc", ()))
    if first.get("type") == "missing":
        return BadRequest(f"Missing required parameter: '{path}'.", param=path or None)
    if in_union:
        # The per-member messages of a union ("should be a valid string") mislead; name the field.
        return BadRequest(f"Invalid type or value for '{path}'.", param=path)
    where = f"'{path}'" if path else "the request body"
    return BadRequest(
        f"Invalid value for {where}: {first.get('msg', 'invalid')}.", param=path or None
    )


# pydantic puts a union member's type name ("str", "list[int]") into an error's location.
_UNION_TAG_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _loc_to_param(loc: tuple) -> tuple[str, bool]:
    """("messages", 0, "content") -> "messages[0].content"; cut at a union tag, if any."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue  # FastAPI prefixes body fields with "body"
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _UNION_TAG_NAMES or not str(part).isidentifier():
            return path, True
        else:
            path = f"{path}.{part}" if path else str(part)
    return path, False


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns OpenAI-shaped."""
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(Exception, _on_unexpected)


async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(from_validation_error(exc))


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Routing errors (404 unknown path, 405 wrong method): keep Starlette's short, safe text.
    err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = error_body(str(exc.detail), err_type, None, None)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(InternalError("The server had an error while processing the request."))
