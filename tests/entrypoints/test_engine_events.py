"""GET /v1/engine/events and /v1/engine/snapshot over a real server: snapshots stream while
requests run and agree with /metrics at the same step (both carry the engine's step count),
bad intervals are 400, the API key guards both, and a client that leaves is unsubscribed."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tinyserve.testing.server import metric_samples, wait_until

KEY = "sk-events"


def _scrape(base_url: str) -> dict[str, float]:
    return {name: value for name, _, value in metric_samples(base_url)}


def _snapshots(response, pings: bool = False):
    """Parse ``event: snapshot`` / ``data:`` pairs; a comment (a ping) yields None if
    ``pings``. One generator per response: dropping one closes the connection."""
    event = None
    for line in response.iter_lines():
        if line.startswith(":") and pings:
            yield None
        elif line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            assert event == "snapshot"
            yield json.loads(line[len("data: ") :])
            event = None


def _run_requests(base_url: str, n: int, max_tokens: int) -> list[int]:
    body = {"prompt": "The live view shows", "max_tokens": max_tokens, "ignore_eos": True}
    statuses = []

    def one(i: int):
        r = httpx.post(base_url + "/v1/completions", json={**body, "seed": i}, timeout=60)
        statuses.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


TOKENS = 40  # long enough that a 10 ms scraper lands on several running steps on a fast CPU


def test_events_stream_and_agree_with_metrics(server):
    scrapes, done = [], threading.Event()

    def scraper():
        while not done.is_set():
            scrapes.append(_scrape(server.base_url))
            time.sleep(0.01)

    snaps = []
    with httpx.stream("GET", server.url("/v1/engine/events?interval_ms=50"), timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _snapshots(r, pings=True)
        snaps.append(next(events))  # on connect, before any request
        threads = [threading.Thread(target=scraper)]
        threads.append(threading.Thread(target=lambda: (_run_requests(server.base_url, 3, TOKENS),
                                                        done.set())))  # fmt: skip
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        for snap in events:
            assert time.monotonic() < deadline, "no idle snapshot after the requests"
            if snap is not None:  # else a ping: the answers may have come since the last one
                snaps.append(snap)
            last = snaps[-1]
            if done.is_set() and len(snaps) > 1 and last["running"] == last["waiting"] == 0:
                break  # the idle snapshot after the 3 requests' answers
        for t in threads:
            t.join()
    idle = _scrape(server.base_url)
    records = {rec["step"]: rec for snap in snaps for rec in snap["steps"]}
    # Each decode row gives one token and its accepted drafts (suffix decoding, the default).
    decoded = sum(rec["decode"] for rec in records.values())
    drafted = sum(rec["spec_tokens"] for rec in records.values())
    assert 3 * (TOKENS - 1) - drafted <= decoded <= 3 * (TOKENS - 1)
    assert sum(len(rec["prefill"]) for rec in records.values()) >= 3
    assert any(rec["prefill"] for rec in records.values())
    assert any(s["running"] > 0 for s in snaps)
    # A scrape at step N saw the same step boundary as the step record N.
    compared = 0
    for g in scrapes:
        rec = records.get(int(g["engine_steps_total"]))
        if rec is not None:
            assert g["num_requests_running"] == rec["running"]
            assert g["num_requests_waiting"] == rec["waiting"]
            assert g["kv_cache_usage_perc"] == pytest.approx(rec["kv_usage"])
            compared += g["num_requests_running"] > 0
    assert compared >= 3
    # Snapshots built after a step describe that step's boundary.
    for snap in snaps[1:]:
        if snap["steps"] and snap["steps"][-1]["step"] == snap["step"]:
            last = snap["steps"][-1]
            assert (snap["running"], snap["waiting"]) == (last["running"], last["waiting"])
            assert snap["kv"]["usage"] == pytest.approx(last["kv_usage"])
        assert len(snap["pool"]) == snap["kv"]["total"]
    # Idle: the last snapshot and /metrics agree on everything.
    final = snaps[-1]
    assert final["step"] == idle["engine_steps_total"]
    assert final["running"] == idle["num_requests_running"] == 0
    assert final["waiting"] == idle["num_requests_waiting"] == 0
    assert final["kv"]["usage"] == pytest.approx(idle["kv_cache_usage_perc"])
    assert final["kv"]["free"] == idle["kv_cache_free_blocks"] == final["kv"]["total"]
    assert wait_until(lambda: server.async_engine.view_feed.num_watchers == 0, 5)


def test_snapshot_endpoint_at_idle_equals_metrics(server):
    snap = httpx.get(server.url("/v1/engine/snapshot"), timeout=10).json()
    g = _scrape(server.base_url)
    assert snap["step"] == g["engine_steps_total"]
    assert (snap["running"], snap["waiting"]) == (0, 0)
    assert snap["kv"]["total"] == g["kv_cache_total_blocks"] == len(snap["pool"])
    assert snap["kv"]["usage"] == g["kv_cache_usage_perc"] and snap["steps"] == []


def test_bad_interval_is_400(fake_server):
    with fake_server() as s:
        for value in ("10", "5001", "abc", "2.5", ""):
            r = httpx.get(s.url(f"/v1/engine/events?interval_ms={value}"), timeout=10)
            assert r.status_code == 400, value
            assert r.json()["error"]["param"] == "interval_ms"
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert s.async_engine.view_feed.num_watchers == 0


def test_api_key_guards_both_routes(fake_server):
    with fake_server(api_key=KEY) as s:
        for path in ("/v1/engine/events", "/v1/engine/snapshot"):
            assert httpx.get(s.url(path), timeout=10).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(s.url("/v1/engine/snapshot"), headers=auth).status_code == 200
        with httpx.stream("GET", s.url("/v1/engine/events"), headers=auth, timeout=10) as r:
            assert r.status_code == 200
            assert next(_snapshots(r))["step"] == 0
        assert wait_until(lambda: s.async_engine.view_feed.num_watchers == 0, 5)


def test_disconnect_unsubscribes(fake_server):
    with fake_server(step_delay=0.005) as s:
        feed, fake = s.async_engine.view_feed, s.engine
        clients = [httpx.Client(base_url=s.base_url, timeout=10) for _ in range(2)]
        streams = [c.stream("GET", "/v1/engine/events?interval_ms=50") for c in clients]
        events = [_snapshots(st.__enter__()) for st in streams]
        for ev in events:
            next(ev)
        assert feed.num_watchers == 2 and wait_until(lambda: fake.step_records is not None)
        body = {"prompt": [1, 2, 3], "max_tokens": 30}
        assert httpx.post(s.url("/v1/completions"), json=body, timeout=10).status_code == 200
        seen = next(events[0])
        assert seen["steps"] and all(rec["decode"] == 1 for rec in seen["steps"])
        for st, c in zip(streams, clients, strict=True):
            st.__exit__(None, None, None)
            c.close()
        assert wait_until(lambda: feed.num_watchers == 0, 5)
        # The engine thread stops recording once the last watcher is gone.
        assert wait_until(lambda: fake.step_records is None, 5)
        built = fake.num_snapshot_calls
        assert httpx.post(s.url("/v1/completions"), json=body, timeout=10).status_code == 200
        assert fake.num_snapshot_calls == built
