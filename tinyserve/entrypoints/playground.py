"""The playground: a chat page and a live engine view at ``/``, from files in ``static/``.

Plain HTML, CSS and JavaScript with no build step and nothing fetched from elsewhere, so
``tinyserve serve`` then opening ``http://127.0.0.1:8321/`` is all it takes. The page itself
loads without the API key (it holds nothing secret); it asks for the key when an API call
answers 401 and then sends it as ``Authorization: Bearer``, like any other client.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from tinyserve.entrypoints.protocol import OpenAIError

_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
}
_STATIC = resources.files("tinyserve.entrypoints") / "static"


def _asset(name: str) -> Response:
    suffix = name[name.rfind(".") :] if "." in name else ""
    path = _STATIC / name
    if "/" in name or suffix not in _TYPES or not path.is_file():
        raise OpenAIError(404, f"no playground file {name!r}", "not_found_error")
    return Response(
        path.read_bytes(),
        media_type=f"{_TYPES[suffix]}; charset=utf-8",
        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"},
    )


def playground_router() -> APIRouter:
    """``/`` (the page) and ``/playground/<file>`` (its scripts and style); no API key."""
    api = APIRouter(include_in_schema=False)

    @api.get("/")
    async def index() -> Response:
        return _asset("index.html")

    @api.get("/playground/{name}")
    async def asset(name: str) -> Response:
        return _asset(name)

    return api
