"""What guards the HTTP routes: the API-key check, the request-body size limit and the
handlers that turn every error into an OpenAI-shaped body."""

from __future__ import annotations

import hmac
import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyserve.entrypoints.protocol import OpenAIError, bad_request
from tinyserve.entrypoints.protocol_anthropic import error_body
from tinyserve.entrypoints.protocol_base import error_messages

logger = logging.getLogger(__name__)

_bearer = HTTPBearer(auto_error=False, description="The server's --api-key")


def _key_error() -> OpenAIError:
    return OpenAIError(
        401,
        "Missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
        "authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _key_matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))  # constant time


def key_accepted(headers, expected: str) -> bool:
    """Either key a request carries matches (api_keys_of): a client configured with a key
    and a token may send both headers, and only one of them need be ours."""
    ok = False
    for given in api_keys_of(headers):
        ok |= _key_matches(given, expected)  # every candidate compared: no early exit
    return ok


async def check_api_key(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> None:
    """The routes' declared dependency (it puts the bearer scheme in the OpenAPI document);
    APIKeyGuard below enforces the key on every path before any route runs."""
    expected: str | None = request.app.state.api_key
    if expected and not key_accepted(request.scope.get("headers", ()), expected):
        raise _key_error()


def route_is_open(path: str, open_routes: tuple[str, ...]) -> bool:
    """``path`` is one of ``open_routes`` (exact paths; ``/prefix/*`` for a folder)."""
    for route in open_routes:
        if route.endswith("/*"):
            if path.startswith(route[:-1]):
                return True
        elif path == route:
            return True
    return False


class APIKeyGuard:
    """ASGI middleware: with an API key, every HTTP request needs ``Authorization: Bearer
    <key>`` before any route (or 404) answers — routes added later included — except the
    paths in ``open_routes`` (--open-routes, --metrics-no-key)."""

    def __init__(self, app, api_key: str | None, open_routes: tuple[str, ...]) -> None:
        self.app = app
        self.api_key = api_key
        self.open_routes = open_routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.api_key:
            return await self.app(scope, receive, send)
        if route_is_open(scope.get("path", ""), self.open_routes):
            return await self.app(scope, receive, send)
        if not key_accepted(scope.get("headers", ()), self.api_key):
            path = scope.get("path", "")
            return await error_response(path, _key_error())(scope, receive, send)
        return await self.app(scope, receive, send)


def api_keys_of(headers) -> list[str]:
    """The keys a request carries: ``Authorization: Bearer <key>`` and (Anthropic's clients)
    ``x-api-key: <key>``, each where present."""
    keys = []
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                keys.append(token.strip())
        elif name == b"x-api-key":
            keys.append(value.decode("latin-1").strip())
    return keys


def anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_response(path: str, err: OpenAIError) -> JSONResponse:
    """``err`` in the shape of the API ``path`` belongs to: Anthropic's on /v1/messages,
    OpenAI's elsewhere."""
    if anthropic_path(path):
        return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)
    return err.response()


class BodySizeLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413, from the
    Content-Length header when there is one, else while the body streams in."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                err = _too_large(self.max_bytes)
                return await error_response(scope.get("path", ""), err)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # answered by the app's HTTPException handler
                    raise _BodyTooLarge(self.max_bytes)
            return message

        return await self.app(scope, limited_receive, send)


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"request body is larger than the server's limit of {max_bytes} bytes "
        "(--max-request-bytes)",
        "invalid_request_error",
        code="request_too_large",
    )


class _BodyTooLarge(StarletteHTTPException):
    """An HTTPException so FastAPI's body parsing re-raises it as is (a 413, not a 400)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413)
        self.max_bytes = max_bytes


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"the body is not valid JSON: {ctx.get('error', err.get('msg'))}", None
    found = error_messages(exc.errors(), skip=("body",))
    # A whole-body check's ValueError ("Value error, guided_json: ..."): its own words, so
    # bad_request reads the field from them.
    found = [(w, m if w else m.removeprefix("Value error, ")) for w, m in found]
    parts = [f"{where}: {msg}" if where else msg for where, msg in found]
    param = next((where for where, _ in found if where), None)
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(request.url.path, bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, _BodyTooLarge):
            return error_response(request.url.path, _too_large(exc.max_bytes))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = OpenAIError(exc.status_code, str(exc.detail), kind, headers=exc.headers)
        return error_response(request.url.path, err)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        err = OpenAIError(500, f"internal error: {type(exc).__name__}", "internal_error")
        return error_response(request.url.path, err)
