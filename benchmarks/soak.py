#!/usr/bin/env python
"""Soak and overload tests against a real tinyserve server, with figures.

Soak: many streaming requests at high concurrency, mixed lengths, chat and completions, some
with ``n=2``, some with stop strings, and a share of clients that hang up at a random point.
Afterwards the server must be idle and whole: no 5xx, the KV pool back to full (prefix-cached
blocks count as free), no request left running or waiting, every completed request's streamed
token count equal to its usage, and the server's RSS flat from the middle of the run to the end.

Overload: many clients at once against a server started with a small ``--max-queued-requests``;
the excess must get 429 (OpenAI error shape, ``Retry-After``) at once, and the admitted ones
must complete.

``python benchmarks/soak.py`` starts its own ``tinyserve serve`` (the default model) for each
part, prints the figures and writes ``benchmarks/results/soak.json``. ``--base-url`` points
the soak at a running server instead (RSS is then measured only with ``--server-pid``).
tests/soak/ runs smaller versions of the same functions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

_SUBJECTS = [
    "the sea", "a lighthouse", "winter", "a robot", "bread", "the moon", "trains", "a garden",
    "rain", "mountains", "a library", "bees", "the desert", "music", "a bridge", "clocks",
]  # fmt: skip
_STOPS = [["."], ["\n"], [" the", " and"], [","], ["!", "?"]]


# -- server processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(args: list[str], log_path: Path, timeout: float = 180.0) -> ServerProcess:
    """``tinyserve serve <args>`` on a free port; returns once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "tinyserve.entrypoints.cli", "serve", "--port", str(port), *args]
    log = open(log_path, "w")  # noqa: SIM115 - the child writes it for its whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"server did not become healthy in {timeout} s:\n{server.log()[-3000:]}")


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def engine_gauges(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """The engine's gauges from /metrics (names without the ``tinyserve:`` prefix)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.type == "gauge" and family.samples:
            out[family.name.removeprefix("tinyserve:")] = family.samples[0].value
    return out


def wait_idle(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the pool is whole; return the last read."""
    deadline = time.monotonic() + timeout
    while True:
        g = engine_gauges(base_url)
        whole = g["kv_cache_free_blocks"] == g["kv_cache_total_blocks"]
        if (g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0 and whole) or (
            time.monotonic() > deadline
        ):
            return g
        time.sleep(0.1)


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


def make_plans(cfg: SoakConfig) -> list[_Plan]:
    rng = random.Random(cfg.seed)
    plans = []
    for i in range(cfg.num_requests):
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
        plans.append(_Plan(i, chat, body, cut))
    return plans


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
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.completed = True
                    break
                events += 1
                chunk = json.loads(line[6:])
                if not chunk["choices"]:
                    out.usage = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    lp = choice.get("logprobs") or {}
                    n_tok = len(lp.get("content") or []) if plan.chat else len(lp.get("tokens", []))
                    i = choice["index"]
                    out.tokens_per_choice[i] = out.tokens_per_choice.get(i, 0) + n_tok
                    if choice.get("finish_reason"):
                        out.finish_per_choice[i] = choice["finish_reason"]
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


def summarize_soak(cfg, plans, outcomes, idle, wall, rss_mid, rss_end) -> dict:
    statuses: dict[str, int] = {}
    mismatches, unfinished, transport_errors = [], [], []
    completed = disconnected = n2 = stops = tokens = 0
    for plan, o in zip(plans, outcomes, strict=True):
        statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
        n2 += plan.body.get("n", 1) == 2
        stops += "stop" in plan.body
        if o.error and o.status is None:
            transport_errors.append((plan.index, o.error))
        if o.disconnected:
            disconnected += 1
            continue
        if o.status != 200:
            continue
        n = plan.body.get("n", 1)
        if not o.completed or len(o.finish_per_choice) != n:
            unfinished.append(plan.index)
            continue
        completed += 1
        streamed = sum(o.tokens_per_choice.values())
        tokens += streamed
        if o.usage != streamed:
            mismatches.append({"request": plan.index, "streamed": streamed, "usage": o.usage})
    num_5xx = sum(v for k, v in statuses.items() if k != "None" and int(k) >= 500)
    growth = None if not (rss_mid and rss_end) else (rss_end - rss_mid) / rss_mid
    return {
        "config": asdict(cfg),
        "wall_s": round(wall, 1),
        "requests": len(plans),
        "with_n2": n2,
        "with_stop": stops,
        "completed": completed,
        "disconnected": disconnected,
        "output_tokens_streamed": tokens,
        "status_counts": statuses,
        "num_5xx": num_5xx,
        "transport_errors": transport_errors[:10],
        "num_transport_errors": len(transport_errors),
        "unfinished_streams": unfinished[:10],
        "num_unfinished_streams": len(unfinished),
        "usage_mismatches": mismatches[:10],
        "num_usage_mismatches": len(mismatches),
        "after": {
            "running": idle["num_requests_running"],
            "waiting": idle["num_requests_waiting"],
            "free_blocks": idle["kv_cache_free_blocks"],
            "total_blocks": idle["kv_cache_total_blocks"],
            "leaked_blocks": idle["kv_cache_total_blocks"] - idle["kv_cache_free_blocks"],
        },
        "rss_mid_mb": None if rss_mid is None else round(rss_mid / 2**20, 1),
        "rss_end_mb": None if rss_end is None else round(rss_end / 2**20, 1),
        "rss_growth": None if growth is None else round(growth, 4),
    }


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
    ok, rejected, shaped = [], [], []
    for r in recs:
        if r["status"] == 200:
            m = re.findall(r'"completion_tokens":\s*(\d+)', r["body"])
            r["usage"] = int(m[-1]) if m and "data: [DONE]" in r["body"] else None
            ok.append(r)
        elif r["status"] == 429:
            rejected.append(r)
            try:
                err = json.loads(r["body"]).get("error")
            except ValueError:
                err = None
            if (
                isinstance(err, dict)
                and err.get("type") == "rate_limit_error"
                and err.get("message")
                and r["headers"].get("retry-after")
            ):
                shaped.append(r)
    statuses = sorted({r["status"] for r in recs})
    return {
        "clients": clients,
        "max_tokens": max_tokens,
        "status_counts": {str(s): sum(r["status"] == s for r in recs) for s in statuses},
        "admitted": len(ok),
        "admitted_completed": sum(r["usage"] == max_tokens for r in ok),
        "rejected_429": len(rejected),
        "rejected_with_error_shape_and_retry_after": len(shaped),
        "max_429_latency_s": round(max((r["headers_s"] for r in rejected), default=0.0), 3),
        "median_429_latency_s": _median([r["headers_s"] for r in rejected]),
        "median_admitted_e2e_s": _median([r["e2e_s"] for r in ok]),
        "after": {
            "running": idle["num_requests_running"],
            "waiting": idle["num_requests_waiting"],
            "leaked_blocks": idle["kv_cache_total_blocks"] - idle["kv_cache_free_blocks"],
        },
    }


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


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


# -- CLI -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="soak a running server instead of starting one")
    p.add_argument("--server-pid", type=int, help="with --base-url: measure this process's RSS")
    p.add_argument("--model", help="model for the servers this script starts (default model)")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--disconnect-frac", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overload-clients", type=int, default=64)
    p.add_argument("--skip-overload", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = p.parse_args(argv)

    cfg = SoakConfig(
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        disconnect_frac=args.disconnect_frac,
        seed=args.seed,
    )
    model = ["--model", args.model] if args.model else []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    logs = Path(args.out).parent
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info()}  # fmt: skip

    if args.base_url:
        soak = run_soak(args.base_url, cfg, args.server_pid, progress=True)
    else:
        seqs = str(max(64, cfg.concurrency * 2))
        server = start_server(
            [*model, "--max-num-seqs", seqs, "--kv-cache-memory", "512MiB"],
            logs / "soak_server.log",
        )
        try:
            soak = run_soak(server.base_url, cfg, server.pid, progress=True)
        finally:
            soak["server_exit_code"] = server.stop()
    soak["failures"] = soak_failures(soak)
    result["soak"] = soak

    if not args.skip_overload and not args.base_url:
        server = start_server(
            [*model, "--max-num-seqs", "8", "--max-queued-requests", "8"],
            logs / "overload_server.log",
        )
        try:
            over = run_overload(server.base_url, args.overload_clients)
        finally:
            over["server_exit_code"] = server.stop()
        over["failures"] = overload_failures(over, max_admitted=16)
        result["overload"] = over

    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    failed = [f for part in ("soak", "overload") for f in result.get(part, {}).get("failures", [])]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
