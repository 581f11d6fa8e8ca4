"""Soak and overload drivers against a running tinyserve server (benchmarks/soak.py runs
them full size, tests/reliability/ smaller).

Soak: many streaming requests at high concurrency, mixed lengths, chat and completions, some
with ``n=2``, some with stop strings, and a share of clients that hang up at a random point.
Afterwards the server must be idle and whole: no 5xx, the KV pool back to full (prefix-cached
blocks count as free), no request left running or waiting, every completed request's streamed
token count equal to its usage, and the server's RSS flat from the middle of the run to the end.

Overload: many clients at once against a server started with a small ``--max-queued-requests``;
the excess must get 429 (OpenAI error shape, ``Retry-After``) at once, and the admitted ones
must complete.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from tinyserve.testing.server import rss_bytes, wait_idle
from tinyserve.testing.soak_report import summarize_overload, summarize_soak
from tinyserve.testing.sse import aiter_data

_SUBJECTS = [
    "the sea", "a lighthouse", "winter", "a robot", "bread", "the moon", "trains", "a garden",
    "rain", "mountains", "a library", "bees", "the desert", "music", "a bridge", "clocks",
]  # fmt: skip
_STOPS = [["."], ["\n"], [" the", " and"], [","], ["!", "?"]]


# -- soak ----------------------------------------------------------------------------------------


@dataclass
class SoakConfig:
    num_requests: int = 500
    concurrency: int = 64
    disconnect_frac: float = 0.3
    n2_frac: float = 0.2
    stop_frac: float = 0.25
    max_tokens_choices: tuple[int, ...] = (4, 8, 16, 32, 64, 128)
    seed: int = 0


@dataclass
class _Plan:
    index: int
    chat: bool
    body: dict
    disconnect_after: int | None  # data events to read before hanging up; None = read all


@dataclass
class _Outcome:
    status: int | None = None
    error: str | None = None
    disconnected: bool = False
    completed: bool = False
    tokens_per_choice: dict[int, int] = field(default_factory=dict)
    finish_per_choice: dict[int, str] = field(default_factory=dict)
    usage: int | None = None


def _plan(rng: random.Random, cfg: SoakConfig, i: int) -> _Plan:
    chat = rng.random() < 0.5
    subject = rng.choice(_SUBJECTS)
    body: dict = {
        "max_tokens": rng.choice(cfg.max_tokens_choices),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": f"Write about {subject}. ({i})"}]
        body["logprobs"] = True
    else:
        body["prompt"] = f"Request {i}. A few words about {subject}:"
        body["logprobs"] = 0
    if rng.random() < cfg.n2_frac:
        body["n"] = 2
    if rng.random() < cfg.stop_frac:
        body["stop"] = rng.choice(_STOPS)
    else:
        body["ignore_eos"] = rng.random() < 0.5
    cut = None
    if rng.random() < cfg.disconnect_frac:
        cut = rng.randint(0, max(1, body["max_tokens"] // 2))
    return _Plan(i, chat, body, cut)


def make_plans(cfg: SoakConfig) -> list[_Plan]:
    rng = random.Random(cfg.seed)
    return [_plan(rng, cfg, i) for i in range(cfg.num_requests)]


def _count_chunk(out: _Outcome, chunk: dict, chat: bool) -> None:
    if not chunk["choices"]:
        out.usage = chunk["usage"]["completion_tokens"]
    for choice in chunk["choices"]:
        lp = choice.get("logprobs") or {}
        n_tok = len(lp.get("content") or []) if chat else len(lp.get("tokens", []))
        i = choice["index"]
        out.tokens_per_choice[i] = out.tokens_per_choice.get(i, 0) + n_tok
        if choice.get("finish_reason"):
            out.finish_per_choice[i] = choice["finish_reason"]


async def _run_one(client: httpx.AsyncClient, plan: _Plan) -> _Outcome:
    out = _Outcome()
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    try:
        async with client.stream("POST", path, json=plan.body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                out.error = r.text[:300]
                return out
            if plan.disconnect_after == 0:
                out.disconnected = True
                return out
            events = 0
            async for data in aiter_data(r.aiter_lines()):
                if data == "[DONE]":
                    out.completed = True
                    break
                events += 1
                _count_chunk(out, json.loads(data), plan.chat)
                if plan.disconnect_after is not None and events >= plan.disconnect_after:
                    out.disconnected = True
                    break
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_soak_async(
    base_url: str, cfg: SoakConfig, server_pid: int | None = None, progress: bool = False
) -> dict:
    plans = make_plans(cfg)
    outcomes: list[_Outcome | None] = [None] * len(plans)
    rss_mid: int | None = None
    done = 0
    sem = asyncio.Semaphore(cfg.concurrency)
    limits = httpx.Limits(max_connections=cfg.concurrency + 8)

    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        async def worker(plan: _Plan) -> None:
            nonlocal done, rss_mid
            async with sem:
                outcomes[plan.index] = await _run_one(client, plan)
            done += 1
            if done == len(plans) // 2 and server_pid is not None:
                rss_mid = rss_bytes(server_pid)
            if progress and done % 50 == 0:
                print(f"  {done}/{len(plans)} requests", file=sys.stderr, flush=True)

        t0 = time.monotonic()
        await asyncio.gather(*(worker(p) for p in plans))
        wall = time.monotonic() - t0

    idle = await asyncio.to_thread(wait_idle, base_url)
    rss_end = rss_bytes(server_pid) if server_pid is not None else None
    return summarize_soak(cfg, plans, outcomes, idle, wall, rss_mid, rss_end)


def run_soak(base_url: str, cfg: SoakConfig, server_pid: int | None = None, progress=False):
    return asyncio.run(run_soak_async(base_url, cfg, server_pid, progress))


def soak_failures(s: dict, max_rss_growth: float = 0.05) -> list[str]:
    """What did not hold (empty when all did)."""
    bad = []
    if s["num_5xx"]:
        bad.append(f"{s['num_5xx']} responses were 5xx")
    if s["num_transport_errors"]:
        bad.append(f"{s['num_transport_errors']} transport errors: {s['transport_errors']}")
    if set(s["status_counts"]) - {"200"}:
        bad.append(f"statuses other than 200: {s['status_counts']}")
    if s["num_unfinished_streams"]:
        bad.append(f"streams without [DONE]/finish_reason: {s['unfinished_streams']}")
    if s["num_usage_mismatches"]:
        bad.append(f"token count != usage: {s['usage_mismatches']}")
    a = s["after"]
    if a["running"] or a["waiting"] or a["leaked_blocks"]:
        bad.append(f"not idle and whole afterwards: {a}")
    if s["rss_growth"] is not None and s["rss_growth"] > max_rss_growth:
        bad.append(f"RSS grew {s['rss_growth']:.1%} from the middle to the end")
    return bad


# -- overload ------------------------------------------------------------------------------------


async def _raw_post(host: str, port: int, path: str, body: bytes, start: asyncio.Event) -> dict:
    """One POST over a raw socket opened in advance, so that the figure is the server's
    answer time, not an HTTP client's overhead (httpx costs milliseconds per request, and
    64 of them at once on 2 cores add up to a second)."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    await start.wait()
    t0 = time.monotonic()
    writer.write(head + body)
    await writer.drain()
    status_line = await reader.readline()
    headers_s = time.monotonic() - t0
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    rest = await reader.read()  # Connection: close -> the server closes after the response
    e2e = time.monotonic() - t0
    writer.close()
    return {
        "status": int(status_line.split()[1]),
        "headers_s": headers_s,
        "e2e_s": e2e,
        "headers": headers,
        "body": rest.decode("utf-8", "replace"),
    }


async def run_overload_async(base_url: str, clients: int = 64, max_tokens: int = 32) -> dict:
    """``clients`` streaming completions sent at once; returns statuses and timings."""
    url = httpx.URL(base_url)
    body = json.dumps(
        {
            "prompt": "Count slowly:",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    start = asyncio.Event()
    tasks = [
        asyncio.create_task(_raw_post(url.host, url.port, "/v1/completions", body, start))
        for _ in range(clients)
    ]
    await asyncio.sleep(0.5)  # all connections open
    start.set()
    recs = await asyncio.gather(*tasks)
    idle = await asyncio.to_thread(wait_idle, base_url)
    return summarize_overload(recs, clients, max_tokens, idle)


def run_overload(base_url: str, clients: int = 64, max_tokens: int = 32) -> dict:
    return asyncio.run(run_overload_async(base_url, clients, max_tokens))


def overload_failures(o: dict, max_admitted: int) -> list[str]:
    bad = []
    if set(o["status_counts"]) - {"200", "429"}:
        bad.append(f"statuses other than 200/429: {o['status_counts']}")
    if o["admitted"] > max_admitted:
        bad.append(f"{o['admitted']} admitted, more than the {max_admitted} the limits allow")
    if o["rejected_429"] < o["clients"] - max_admitted:
        bad.append(f"only {o['rejected_429']} got 429")
    if o["admitted_completed"] != o["admitted"]:
        bad.append(f"{o['admitted'] - o['admitted_completed']} admitted requests did not complete")
    if o["rejected_with_error_shape_and_retry_after"] != o["rejected_429"]:
        bad.append("a 429 lacked the error shape or Retry-After")
    if o["rejected_429"] and o["max_429_latency_s"] >= 1.0:
        bad.append(f"a 429 took {o['max_429_latency_s']} s (should be immediate)")
    if any(o["after"].values()):
        bad.append(f"not idle and whole afterwards: {o['after']}")
    return bad
