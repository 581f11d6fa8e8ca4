"""Issue 38's check of a request's walk through the server's entrypoints modules, on a
FakeEngine server (no model): which tinyserve.entrypoints module calls which while one
request is served (``walk``), and the serving modules in the order the calls enter them.

A call counts once per (caller module, callee module) pair: an API's class calling three
shared steps is one arrow ``serving_chat -> serving``, and a base calling back into the
API's class would show as the arrow back, ``serving -> serving_chat``."""

from __future__ import annotations

import threading
from collections import Counter

import httpx

from tests.support.fake_engine import FakeEngine
from tinyserve.config import ServerConfig
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.testing.server import serve

PACKAGE = "tinyserve.entrypoints."


def _module(frame) -> str:
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class Walk:
    def __init__(self) -> None:
        self.arrows: Counter[tuple[str, str]] = Counter()  # (caller, callee) module names
        self.entered: list[str] = []  # modules in the order calls entered them
        self.on = False

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or not self.on:
            return
        callee = _module(frame)
        if not callee.startswith(PACKAGE):
            return
        callee = callee.removeprefix(PACKAGE)
        caller = _module(frame.f_back)
        if caller.startswith(PACKAGE) and caller.removeprefix(PACKAGE) != callee:
            self.arrows[(caller.removeprefix(PACKAGE), callee)] += 1
        if not self.entered or self.entered[-1] != callee:
            self.entered.append(callee)

    def serving_order(self) -> list[str]:
        """The serving modules (api_server and serving*) by their first entry."""
        order: list[str] = []
        for m in self.entered:
            if (m == "api_server" or m.startswith("serving")) and m not in order:
                order.append(m)
        return order

    def arrows_between_serving(self) -> set[tuple[str, str]]:
        return {
            (a, b)
            for a, b in self.arrows
            if (a == "api_server" or a.startswith("serving")) and b.startswith("serving")
        }


def walk(tokenizer, path: str, body: dict, stream: bool = False) -> tuple[int, Walk]:
    """Serve one request at ``path`` (after one untraced warm-up) and trace it."""
    w = Walk()
    threading.setprofile(w)  # the server's threads start after this: all of them traced
    try:
        engine = AsyncEngine(FakeEngine(tokenizer=tokenizer), max_queued_requests=4)
        with serve(engine, ServerConfig()) as s, httpx.Client(base_url=s.base_url) as c:
            c.post(path, json=body).raise_for_status()
            w.on = True
            if stream:
                with c.stream("POST", path, json={**body, "stream": True}) as r:
                    status = r.status_code
                    for _ in r.iter_lines():
                        pass
            else:
                status = c.post(path, json=body).status_code
            w.on = False
    finally:
        threading.setprofile(None)
    return status, w
