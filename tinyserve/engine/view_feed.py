"""ViewFeed: the live engine view's snapshots, from the engine thread to every SSE watcher.

Threads:

* The loop thread subscribes and unsubscribes watchers (``subscribe`` / ``Watcher.close``),
  which sets ``num_watchers`` and posts a ``("watch", ...)`` command on the engine's inbox;
  it also fans each snapshot out to the watchers' bounded queues (``_publish``).
* The engine thread reads ``num_watchers`` after each step and does nothing more when it is
  0. Watched, it builds a snapshot (``SyncEngine.snapshot``) at most every ``interval_s``
  (the smallest interval any watcher asked for), one for a watcher that just connected and
  one when the engine goes idle, and hands each to the loop with ``call_soon_threadsafe``.

A watcher gets a snapshot at most every its own interval (its steps are merged meanwhile),
and one that reads slowly loses its oldest snapshots, never the steps they carried (merged
into the next, up to MAX_STEPS): the engine thread never waits for anyone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tinyserve.engine.client import EngineDeadError, SyncEngine
from tinyserve.engine.engine_view import MAX_STEPS

logger = logging.getLogger(__name__)

WATCHER_QUEUE = 4  # snapshots a watcher may have unread before the oldest is dropped
_ALL = object()  # publish target: every watcher gets this snapshot now (idle)


class Watcher:
    """One subscriber (an SSE client). ``await get()`` the next snapshot; None once the
    engine has stopped. ``close()`` (idempotent) unsubscribes."""

    def __init__(self, feed: ViewFeed, interval_s: float) -> None:
        self.interval_s = interval_s
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=WATCHER_QUEUE)
        self._feed = feed
        self._pending: list[dict] = []  # steps of snapshots held back by the interval
        self._last_sent = float("-inf")
        self.closed = False

    async def get(self) -> dict | None:
        return await self.queue.get()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._feed._unsubscribe(self)

    def offer(self, snap: dict, now: float, force: bool) -> None:
        """Queue ``snap`` (with any steps held back) unless the interval holds it back."""
        steps = self._pending + snap["steps"] if self._pending else snap["steps"]
        if not force and now - self._last_sent < self.interval_s:
            self._pending = steps[-MAX_STEPS:]
            return
        self._pending = []
        self._last_sent = now
        item = {**snap, "steps": steps[-MAX_STEPS:]}
        if not self.queue.full():
            self.queue.put_nowait(item)
            return
        # A slow reader: drop the oldest snapshot, its steps go to the one after it.
        items = [self.queue.get_nowait() for _ in range(self.queue.qsize())] + [item]
        oldest, after = items[0], items[1]
        if oldest is not None and after is not None:
            items[1] = {**after, "steps": (oldest["steps"] + after["steps"])[-MAX_STEPS:]}
        for kept in items[1:]:
            self.queue.put_nowait(kept)

    def end(self) -> None:
        if self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class ViewFeed:
    def __init__(
        self,
        engine: SyncEngine,
        post: Callable[[tuple], None],
        call_in_loop: Callable[..., None],
    ) -> None:
        self._engine = engine
        self._post = post  # put a command on the engine thread's inbox and wake it
        self._call_in_loop = call_in_loop
        self._watchers: set[Watcher] = set()  # loop thread only
        self.num_watchers = 0  # written by the loop thread, read by the engine thread
        self.interval_s = 0.25  # the smallest watcher interval (loop writes, engine reads)
        self.num_snapshots = 0  # built by the engine thread (tests count them)
        self._last_build = float("-inf")  # engine thread
        # Engine thread: a step ran since the last idle snapshot. Not reset by the snapshots
        # built between steps: a watcher may hold one of those back (its interval runs on the
        # loop thread's clock), and the idle one must still come.
        self._busy = False
        self._ended = False
        self._futures: set[asyncio.Future] = set()  # on-demand snapshots not answered yet

    # -- the loop thread -------------------------------------------------------------------------

    def subscribe(self, interval_s: float) -> Watcher:
        """A new watcher; its first snapshot comes as soon as the engine thread is between
        steps. Raises EngineDeadError once the engine has stopped."""
        if self._ended:
            raise EngineDeadError("the engine has stopped")
        watcher = Watcher(self, interval_s)
        self._watchers.add(watcher)
        self._update()
        self._post(("watch", watcher))
        return watcher

    def _unsubscribe(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)
        self._update()
        self._post(("watch", None))

    def _update(self) -> None:
        if self._watchers:
            self.interval_s = min(w.interval_s for w in self._watchers)
        self.num_watchers = len(self._watchers)

    async def snapshot(self) -> dict:
        """One snapshot on demand (its ``steps`` empty: those go to the watchers)."""
        if self._ended:
            raise EngineDeadError("the engine has stopped")
        future = asyncio.get_running_loop().create_future()
        self._futures.add(future)
        self._post(("snapshot", future))
        try:
            return await future
        finally:
            self._futures.discard(future)

    def _publish(self, snap: dict, target: object) -> None:
        now = time.monotonic()
        for watcher in list(self._watchers):
            watcher.offer(snap, now, force=target is _ALL or target is watcher)

    def end(self) -> None:
        """The engine stopped: every watcher's stream ends, and no new one starts."""
        self._ended = True
        for watcher in list(self._watchers):
            watcher.end()
        for future in self._futures:
            _resolve(future, None, EngineDeadError("the engine has stopped"))

    # -- the engine thread -----------------------------------------------------------------------

    def on_command(self, cmd: tuple) -> None:
        kind, target = cmd
        if kind == "snapshot":
            try:
                snap = self._engine.snapshot(take_steps=False)
            except Exception as e:  # noqa: BLE001 - a view bug must not kill the engine
                logger.exception("building an engine snapshot failed")
                self._call_in_loop(_resolve, target, None, e)
                return
            self.num_snapshots += 1
            self._call_in_loop(_resolve, target, snap, None)
            return
        self._engine.watch(self.num_watchers > 0)
        if target is not None:  # a new watcher: its first snapshot now
            self._build(target)

    def after_step(self) -> None:
        """Called after every step while ``num_watchers`` > 0."""
        self._busy = True
        if time.monotonic() - self._last_build >= self.interval_s:
            self._build(None)

    def on_idle(self) -> None:
        """The engine has nothing left: the final (empty) state, once per busy period."""
        if self._busy and self.num_watchers:
            self._busy = False
            self._build(_ALL)

    def _build(self, target: object) -> None:
        try:
            snap = self._engine.snapshot(take_steps=True)
        except Exception:  # noqa: BLE001 - a view bug must not kill the engine
            logger.exception("building an engine snapshot failed")
            return
        self.num_snapshots += 1
        self._last_build = time.monotonic()
        self._call_in_loop(self._publish, snap, target)


def _resolve(future: asyncio.Future, snap: dict | None, error: BaseException | None) -> None:
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(snap)
