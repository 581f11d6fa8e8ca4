#!/usr/bin/env python
"""Load test for any OpenAI-compatible server (ours or a peer), asyncio + httpx.

Every request streams with ``stream_options.include_usage``. Metrics follow vLLM's
benchmark definitions:
  TTFT  time from sending to the first chunk that carries content
  ITL   gaps between consecutive content chunks
  TPOT  (e2e - TTFT) / (output_tokens - 1), output tokens from the usage chunk
  e2e   time from sending to the end of the stream
Token counts come from the ``usage`` object (tinyserve, vLLM and llama-server send it in a
final chunk with empty choices; one attached to a chunk with choices is read too). A stream
without usage falls back to counting content chunks (a lower bound: one token per chunk),
and the summary's ``token_count_source`` says which.

Prompts are salted per run: a random nonce line (``--salt``) starts the first message of
every request, so a prefix cache that outlives a run (vLLM's, llama-server's slots and
``--cache-ram`` prompt cache, tinyserve's) cannot turn the next run into cache hits. The
salt is drawn once per run, so ``shared_prefix`` requests still share their prefix within
the run. ``--salt none`` turns it off (deterministic prompts).

Examples:
  python benchmarks/bench_serving.py --workload mixed --num-requests 64 --concurrency 8
  python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --request-rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from tinyserve.testing.sse import aiter_data  # noqa: E402
from tinyserve.testing.stats import summary as stats_summary  # noqa: E402

_WORDS = (
    "the quick brown fox jumps over lazy dog river mountain city light shadow music paper "
    "garden window ocean forest engine signal number letter story market winter summer "
    "morning evening bridge island planet teacher student science history language memory "
    "machine network kernel compiler protocol battery circuit harbor desert valley thunder"
).split()
_TOPICS = [
    "the water cycle",
    "how a bicycle works",
    "the history of tea",
    "why the sky is blue",
    "volcanoes",
    "the moon landing",
    "photosynthesis",
    "how vaccines work",
    "black holes",
    "the printing press",
    "honey bees",
    "rainbows",
    "the Roman empire",
    "electric cars",
    "coffee",
    "chess openings",
    "the internet",
    "glaciers",
    "octopuses",
    "jazz music",
]
_ASKS = [
    "Explain {t} in a few sentences.",
    "Write a short poem about {t}.",
    "Give three facts about {t}.",
    "What should a child know about {t}?",
    "Summarize {t} for a busy reader.",
    "Tell a very short story involving {t}.",
]


@dataclass
class BenchRequest:
    messages: list[dict]
    prompt: str
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    usage: bool = False  # token counts came from a usage object, not from counting chunks
    error: str = ""


def _filler(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def new_salt() -> str:
    """A fresh per-run nonce for make_workload's ``salt``."""
    return secrets.token_hex(4)


WORKLOADS = ("mixed", "shared_prefix", "long_prompt", "grounded")


def make_workload(name: str, num_requests: int, seed: int, salt: str = "") -> list[BenchRequest]:
    """Deterministic request sets: the same (name, n, seed, salt) always gives the same requests.

    A non-empty ``salt`` becomes a first line ``Run <salt>.`` of the first message of every
    request (the system message for shared_prefix, so the prefix stays shared within a run).
    """
    rng = random.Random(seed)
    head = f"Run {salt}.\n" if salt else ""
    reqs: list[BenchRequest] = []
    if name == "mixed":
        for _ in range(num_requests):
            text = head + rng.choice(_ASKS).format(t=rng.choice(_TOPICS))
            r = rng.random()  # high-variance output lengths in 16..256
            if r < 0.5:
                mt = rng.randint(16, 32)
            elif r < 0.8:
                mt = rng.randint(64, 128)
            else:
                mt = rng.randint(192, 256)
            reqs.append(BenchRequest([{"role": "user", "content": text}], text, mt))
    elif name == "shared_prefix":
        system = (
            head
            + "You are a careful assistant. Background notes: "
            + _filler(random.Random(1234), 330)
        )
        for _ in range(num_requests):
            q = rng.choice(_ASKS).format(t=rng.choice(_TOPICS))
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            reqs.append(BenchRequest(msgs, system + "\n" + q, 32))
    elif name == "long_prompt":
        for _ in range(num_requests):
            text = head + "Summarize these notes: " + _filler(rng, 1250)
            reqs.append(BenchRequest([{"role": "user", "content": text}], text, 32))
    elif name == "grounded":
        reqs = _grounded(rng, num_requests, head)
    else:
        raise ValueError(f"unknown workload {name!r}: use {', '.join(WORKLOADS)}")
    return reqs


_GROUNDED_ASKS = [
    "Repeat this code exactly, without any changes:",
    "Rewrite this code with the variable names unchanged, adding a short comment above "
    "each function:",
    "Quote the first two functions of this code verbatim:",
    "Copy this code and fix any typo you find, changing nothing else:",
]


def _grounded(rng: random.Random, num_requests: int, head: str) -> list[BenchRequest]:
    """Input-grounded requests (speculative decoding's case): a ~300-token passage of
    Python (cut from tinyserve's own sources, at a line boundary) with an instruction to
    repeat, lightly edit or quote it."""
    root = Path(__file__).resolve().parent.parent / "tinyserve"
    sources = sorted(root.rglob("*.py"))
    reqs = []
    for _ in range(num_requests):
        lines = []
        while sum(len(x) for x in lines) < 1000:
            text = rng.choice(sources).read_text(encoding="utf-8").splitlines(keepends=True)
            start = rng.randrange(max(1, len(text) - 40))
            lines = text[start : start + 40]
        passage = "".join(lines)[:1200]
        ask = head + rng.choice(_GROUNDED_ASKS) + "\n\n```python\n" + passage + "\n```"
        reqs.append(BenchRequest([{"role": "user", "content": ask}], ask, rng.randint(128, 256)))
    return reqs


async def _one(client: httpx.AsyncClient, args, model: str, req: BenchRequest) -> RequestResult:
    body: dict = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if args.endpoint == "chat":
        url = "/v1/chat/completions"
        body["messages"] = req.messages
    else:
        url = "/v1/completions"
        body["prompt"] = req.prompt
    res = RequestResult(ok=False)
    start = time.perf_counter()
    last = None
    content_chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for data in aiter_data(resp.aiter_lines()):
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage")
                if usage:  # usually a final chunk of its own, with empty choices
                    res.prompt_tokens = usage.get("prompt_tokens") or 0
                    res.output_tokens = usage.get("completion_tokens") or 0
                    res.usage = True
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        res.cached_tokens = details["cached_tokens"]
                choices = chunk.get("choices") or []
                has_content = any(
                    (c.get("delta") or {}).get("content") or c.get("text") for c in choices
                )
                if not has_content:
                    continue
                content_chunks += 1
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = time.perf_counter() - start
        if not res.usage:  # no usage object: one token per content chunk (a lower bound)
            res.output_tokens = content_chunks
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no output"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _salt_arg(value: str | None) -> str:
    if value is None:
        return new_salt()
    return "" if value.lower() in ("", "none", "off") else value


async def run_benchmark(args) -> dict:
    salt = _salt_arg(getattr(args, "salt", None))
    reqs = make_workload(args.workload, args.num_requests, args.seed, salt)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(64, args.concurrency or 64))
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=httpx.Timeout(600.0), limits=limits
    ) as client:
        model = args.model
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        bar = None
        if not args.no_progress:
            try:
                from tqdm import tqdm

                bar = tqdm(total=len(reqs), desc=f"{args.workload}", unit="req", file=sys.stderr)
            except ImportError:
                bar = None
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        rng = random.Random(args.seed + 1)

        async def guarded(r: BenchRequest) -> RequestResult:
            if sem is None:
                out = await _one(client, args, model, r)
            else:
                async with sem:
                    out = await _one(client, args, model, r)
            if bar is not None:
                bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for r in reqs:
            tasks.append(asyncio.create_task(guarded(r)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    prompt_tokens = sum(r.prompt_tokens for r in good)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    with_usage = sum(r.usage for r in good)
    cached = [r.cached_tokens for r in good if r.cached_tokens is not None]
    source = "usage" if with_usage == len(good) else "content_chunks" if not with_usage else "mixed"
    summary = {
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "workload": args.workload,
        "num_requests": len(reqs),
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "label": args.label,
        "seed": args.seed,
        "salt": salt,
        "duration_s": duration,
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_throughput": len(good) / duration,
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + prompt_tokens) / duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "token_count_source": source,
        # prompt tokens the server says it served from its prefix cache (None: not reported)
        "cached_prompt_tokens": sum(cached) if cached else None,
        "ttft_s": stats_summary([r.ttft for r in good]),
        "tpot_s": stats_summary(tpots),
        "itl_s": stats_summary([x for r in good for x in r.itl]),
        "e2e_s": stats_summary([r.e2e for r in good]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine_info(),
    }
    return summary


def print_summary(s: dict) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1000:.1f}"  # noqa: E731
    print(
        f"== {s['label'] or s['base_url']} | {s['workload']} | {s['endpoint']} | "
        f"concurrency={s['concurrency']} rate={s['request_rate']}"
    )
    print(
        f"completed {s['completed']}/{s['num_requests']} in {s['duration_s']:.1f}s, failed {s['failed']}"
        f" (salt {s['salt'] or 'none'}, tokens from {s['token_count_source']})"
    )
    for e in s["errors"]:
        print(f"  error: {e}")
    print(
        f"request throughput {s['request_throughput']:.2f} req/s, output {s['output_tok_s']:.1f} tok/s, "
        f"total {s['total_tok_s']:.1f} tok/s"
    )
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        st = s[key]
        print(
            f"{key[:-2].upper():>5} ms: mean {ms(st['mean'])}  median {ms(st['median'])}  p99 {ms(st['p99'])}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8321")
    p.add_argument("--model", default=None, help="default: the first id from /v1/models")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="mixed",
    )
    p.add_argument("--num-requests", type=int, default=64)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--concurrency", type=int, default=None)
    g.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, req/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--salt",
        default=None,
        help="per-run prompt nonce (default: a fresh random one per run; 'none' disables)",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None, help="write the JSON summary here")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.concurrency and not args.request_rate:
        args.concurrency = 1
    summary = asyncio.run(run_benchmark(args))
    print_summary(summary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
