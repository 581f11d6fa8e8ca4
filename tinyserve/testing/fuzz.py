"""Fuzz drivers for the HTTP API: schemathesis against the server's own OpenAPI document,
plus the hand-written hostile requests of :mod:`tinyserve.testing.fuzz_cases`. Nothing may
answer 5xx, every 4xx must carry the OpenAI error shape, and the server must stay healthy
and idle afterwards (benchmarks/fuzz.py runs them full size, tests/reliability/ smaller).

The server under test runs the real engine over a tiny random Llama that uses SmolLM2's
tokenizer and chat template (:func:`tinyserve.testing.checkpoints.build_fuzz_model`), so
that the thousands of requests the fuzzer makes valid finish in milliseconds each.
"""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tinyserve.testing.checkpoints import build_fuzz_model
from tinyserve.testing.fuzz_cases import Hostile, hostile_cases
from tinyserve.testing.fuzz_report import hostile_result, schemathesis_result, tally_summary

MAX_REQUEST_BYTES = 1 << 20  # the fuzz server's --max-request-bytes
MAX_MODEL_LEN = 128  # bounds the work a valid generated request can ask for


# -- checking one response -----------------------------------------------------------------------


def error_shape_problem(status: int, body: bytes, anthropic: bool = False) -> str | None:
    """None if a 4xx/5xx body is ``{"error": {"message": str, "type": str, ...}}`` (OpenAI's,
    with param and code), or with ``anthropic`` ``{"type": "error", "error": {"type",
    "message"}}`` (the /v1/messages routes)."""
    try:
        data = json.loads(body)
    except ValueError:
        return f"{status} body is not JSON: {body[:200]!r}"
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        return f"{status} body has no error object: {body[:200]!r}"
    if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return f"{status} error lacks message/type: {err}"
    if anthropic:
        return None if data.get("type") == "error" else f"{status} not Anthropic's shape: {data}"
    if not {"param", "code"} <= set(err):
        return f"{status} error lacks param/code: {err}"
    return None


@dataclass
class Tally:
    """Statuses seen and what did not hold."""

    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    bad_shapes: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def record(self, label: str, status: int, body: bytes, expected=None) -> None:
        self.cases += 1
        self.statuses[status] += 1
        if status >= 500:
            self.server_errors.append(f"{label}: {status} {body[:300]!r}")
        if status >= 400:
            problem = error_shape_problem(status, body, " /v1/messages" in label)
            if problem:
                self.bad_shapes.append(f"{label}: {problem}")
        if expected is not None and status not in expected:
            self.unexpected.append(
                f"{label}: {status} (expected {sorted(expected)}) {body[:200]!r}"
            )

    def summary(self) -> dict:
        return tally_summary(self)


def fuzz_failures(r: dict) -> list[str]:
    bad = []
    if r["num_5xx"]:
        bad.append(f"{r['num_5xx']} answers were 5xx: {r['server_errors'][:5]}")
    if r["num_bad_error_shapes"]:
        bad.append(
            f"{r['num_bad_error_shapes']} errors lack the OpenAI shape: {r['bad_error_shapes'][:5]}"
        )
    if r.get("num_unexpected_status"):
        bad.append(f"unexpected statuses: {r['unexpected_status'][:10]}")
    if r.get("num_transport_errors"):
        bad.append(f"transport errors: {r['transport_errors'][:5]}")
    if not r["healthy_after"]:
        bad.append("/health was not 200 afterwards")
    return bad


# -- hostile requests -----------------------------------------------------------------------------


def _send_raw(base_url: str, case: Hostile) -> tuple[int, bytes]:
    """For what an HTTP client refuses to send (a Content-Length that lies). A body shorter
    than its Content-Length makes the server wait for the rest: we half-close, so it sees EOF."""
    url = httpx.URL(base_url)
    headers = {"host": f"{url.host}:{url.port}", "content-type": "application/json",
               "connection": "close", **case.headers}  # fmt: skip
    head = f"{case.method} {case.path} HTTP/1.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()
    )
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n" + case.body)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    if not data:
        return 0, b""  # closed without an answer: counted as an unexpected status
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    status = int(head_bytes.split()[1])
    if b"transfer-encoding: chunked" in head_bytes.lower():
        body = _unchunk(body)
    return status, body


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size.split(b";")[0] or b"0", 16)
        if n == 0:
            break
        out += rest[:n]
        data = rest[n + 2 :]
    return out


def _send(client: httpx.Client, case: Hostile) -> httpx.Response:
    headers = dict(case.headers)
    if case.name == "10 MB body, chunked":

        def chunks():
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"a" * (1 << 20)
            yield b'"}'

        headers["content-type"] = "application/json"
        return client.request(case.method, case.path, content=chunks(), headers=headers)
    if isinstance(case.body, bytes):
        headers.setdefault("content-type", "application/json")
        return client.request(case.method, case.path, content=case.body, headers=headers)
    if case.body is None:
        return client.request(case.method, case.path, headers=headers)
    return client.request(case.method, case.path, json=case.body, headers=headers)


def run_hostile(base_url: str, headers: dict | None = None) -> dict:
    tally = Tally()
    transport_errors = []
    t0 = time.monotonic()
    with httpx.Client(base_url=base_url, timeout=120, headers=headers) as client:
        for case in hostile_cases():
            if "content-length" in case.headers:
                tally.record(case.name, *_send_raw(base_url, case), case.expected)
                continue
            try:
                r = _send(client, case)
            except httpx.HTTPError as e:
                transport_errors.append(f"{case.name}: {type(e).__name__}: {e}")
                continue
            tally.record(case.name, r.status_code, r.content, case.expected)
        healthy = client.get("/health").status_code == 200
    return hostile_result(tally, transport_errors, healthy, time.monotonic() - t0)


# -- schemathesis ---------------------------------------------------------------------------------


ENDLESS_STREAMS = ("/v1/engine/events",)  # server-sent events that never end by themselves


class _SchemaFuzz:
    """The state of one schemathesis run: what was sent and what came back."""

    def __init__(self, base_url: str, max_examples: int, seed: int) -> None:
        self.base_url, self.max_examples, self.seed = base_url, max_examples, seed
        self.tally = Tally()
        self.per_op: dict[str, dict] = {}
        self.unsendable = 0
        self.transport_errors: list[str] = []

    def send(self, client: httpx.Client, key: str, case) -> None:
        kw = case.as_transport_kwargs(base_url=self.base_url)
        drop = ("user-agent", "x-schemathesis-testcaseid")
        headers = {k: v for k, v in (kw.get("headers") or {}).items() if k.lower() not in drop}
        request = client.build_request(
            kw["method"],
            case.formatted_path,
            params=kw.get("params"),
            headers=headers,
            json=kw.get("json"),
            content=kw.get("data"),
        )
        try:
            # An endless event stream answers with its status and first event; others in full.
            r = client.send(request, stream=True)
            try:
                endless = r.status_code == 200 and case.path in ENDLESS_STREAMS
                content = next(r.iter_bytes(), b"") if endless else r.read()
            finally:
                r.close()
        except httpx.LocalProtocolError:  # e.g. a header value HTTP forbids: never sent
            self.unsendable += 1
            return
        except httpx.TransportError as e:  # the server dropped the connection
            self.transport_errors.append(
                f"{key}: {type(e).__name__}: {e}: {case.as_curl_command()}"
            )
            return
        self.tally.record(f"{key}: {case.as_curl_command()[:300]}", r.status_code, content)

    def fuzz(self, client: httpx.Client, op, mode) -> None:
        import hypothesis
        import hypothesis.errors
        from hypothesis import HealthCheck, Phase, given, settings

        key = f"{op.method.upper()} {op.path} {mode.value}"
        before = self.tally.cases
        config = settings(
            max_examples=self.max_examples,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        test = given(case=op.as_strategy(generation_mode=mode))(
            lambda case: self.send(client, key, case)
        )
        start = time.monotonic()
        try:
            hypothesis.seed(self.seed)(config(test))()
        except hypothesis.errors.Unsatisfiable:
            pass  # no request can violate a schema without parameters (GET /v1/models)
        self.per_op[key] = {
            "cases": self.tally.cases - before,
            "wall_s": round(time.monotonic() - start, 1),
        }


def run_schemathesis(
    base_url: str, max_examples: int = 100, seed: int = 0, headers: dict | None = None
) -> dict:
    """Hypothesis-generated requests from /openapi.json: positive (valid by the schema) and
    negative (violating it) cases for every operation."""
    import schemathesis

    raw = httpx.get(base_url + "/openapi.json", headers=headers, timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    run = _SchemaFuzz(base_url, max_examples, seed)
    t0 = time.monotonic()
    with httpx.Client(base_url=base_url, timeout=120, headers=headers) as client:
        for result in schema.get_all_operations():
            for mode in schemathesis.GenerationMode:
                run.fuzz(client, result.ok(), mode)
        healthy = client.get("/health").status_code == 200
    return schemathesis_result(run, healthy, time.monotonic() - t0)


# -- the fuzz server ------------------------------------------------------------------------------


def fuzz_model_dir() -> Path:
    """The fuzz model in the cache folder (built on first use)."""
    from tinyserve.models.default_model import ensure_default_model, tokenizer_dir_for
    from tinyserve.utils.cache import cache_dir

    tok = tokenizer_dir_for(ensure_default_model(progress=False))
    return build_fuzz_model(cache_dir() / "models" / "fuzz-tiny-llama-smollm2-vocab", tok)


def server_args(model_dir: Path) -> list[str]:
    return [
        "--model", str(model_dir), "--max-num-seqs", "16", "--kv-cache-memory", "64MiB",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-queued-requests", "64",
    ]  # fmt: skip
