"""The live engine view over HTTP, behind the API key like /v1/*:

* ``GET /v1/engine/events?interval_ms=250``: server-sent events, one ``event: snapshot`` with
  ``data: <json>`` on connect, then at most every ``interval_ms`` (50..5000) while the engine
  works, one when it goes idle, and a ``: ping`` comment every few seconds meanwhile.
* ``GET /v1/engine/snapshot``: one snapshot as JSON (its ``steps`` empty).

Both are built on the engine thread (engine/view_feed.py, engine/engine_view.py has the
format); this module only frames them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from tinyserve.engine.client import EngineDeadError
from tinyserve.engine.view_feed import Watcher
from tinyserve.entrypoints.http_guards import check_api_key
from tinyserve.entrypoints.protocol import bad_request
from tinyserve.entrypoints.streaming import engine_error

DEFAULT_INTERVAL_MS = 250
MIN_INTERVAL_MS, MAX_INTERVAL_MS = 50, 5000
PING_SECONDS = 5.0


def parse_interval_ms(raw: str | None) -> int:
    """``interval_ms`` from the query string; a 400 naming the param otherwise."""
    if raw is None:
        return DEFAULT_INTERVAL_MS
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not MIN_INTERVAL_MS <= value <= MAX_INTERVAL_MS:
        raise bad_request(
            f"interval_ms: must be an integer in [{MIN_INTERVAL_MS}, {MAX_INTERVAL_MS}], "
            f"got {raw!r}",
            "interval_ms",
        )
    return value


def _dumps(snap: dict) -> str:
    return json.dumps(snap, separators=(",", ":"))


async def _events(watcher: Watcher) -> AsyncIterator[ServerSentEvent]:
    try:
        while (snap := await watcher.get()) is not None:
            yield ServerSentEvent(data=_dumps(snap), event="snapshot")
    finally:
        watcher.close()  # the client went away (cancelled here) or the engine stopped


def engine_events_router() -> APIRouter:
    api = APIRouter(dependencies=[Depends(check_api_key)])

    @api.get("/v1/engine/events", response_class=Response)
    async def engine_events(request: Request, interval_ms: str | None = None) -> Response:
        """Live engine view: `text/event-stream` of `snapshot` events."""
        interval = parse_interval_ms(interval_ms)
        try:
            watcher = request.app.state.async_engine.view_feed.subscribe(interval / 1000.0)
        except EngineDeadError as e:
            raise engine_error(e) from None
        return EventSourceResponse(
            _events(watcher),
            sep="\n",
            ping=PING_SECONDS,
            ping_message_factory=lambda: ServerSentEvent(comment="ping"),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @api.get("/v1/engine/snapshot")
    async def engine_snapshot(request: Request) -> JSONResponse:
        """One snapshot of the live engine view (queues, KV pool), as JSON."""
        try:
            snap = await request.app.state.async_engine.view_feed.snapshot()
        except EngineDeadError as e:
            raise engine_error(e) from None
        return JSONResponse(snap)

    return api
