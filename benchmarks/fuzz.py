#!/usr/bin/env python
"""Fuzz the HTTP API: schemathesis against the server's own OpenAPI document, plus a
hand-written list of hostile requests. Nothing may answer 5xx, every 4xx must carry the
OpenAI error shape, and the server must stay healthy and idle afterwards.

The server under test runs the real engine (scheduler, paged KV cache, sampler, detokenizer,
stop strings) over a tiny random Llama that uses SmolLM2's tokenizer and chat template, so
that the thousands of requests the fuzzer makes valid finish in milliseconds each. Only the
weights differ from the default model's server.

``python benchmarks/fuzz.py`` builds that model (once, in the cache folder), starts
``tinyserve serve`` on it, runs both parts, prints the figures and writes
``benchmarks/results/fuzz.json``. tests/server/test_fuzz.py runs the same functions smaller.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MAX_REQUEST_BYTES = 1 << 20  # the fuzz server's --max-request-bytes
MAX_MODEL_LEN = 128  # bounds the work a valid generated request can ask for

# -- the model under the fuzz server -------------------------------------------------------------


def build_fuzz_model(dest: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary, tokenizer and chat template
    (safetensors + config.json + tokenizer files). Idempotent."""
    if (dest / "config.json").exists() and (dest / "model.safetensors").exists():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp / f.name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


# -- checking one response -----------------------------------------------------------------------


def error_shape_problem(status: int, body: bytes) -> str | None:
    """None if a 4xx/5xx body is ``{"error": {"message": str, "type": str, ...}}``."""
    try:
        data = json.loads(body)
    except ValueError:
        return f"{status} body is not JSON: {body[:200]!r}"
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        return f"{status} body has no error object: {body[:200]!r}"
    if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return f"{status} error lacks message/type: {err}"
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
            problem = error_shape_problem(status, body)
            if problem:
                self.bad_shapes.append(f"{label}: {problem}")
        if expected is not None and status not in expected:
            self.unexpected.append(
                f"{label}: {status} (expected {sorted(expected)}) {body[:200]!r}"
            )

    def summary(self) -> dict:
        return {
            "cases": self.cases,
            "status_counts": {str(k): v for k, v in sorted(self.statuses.items())},
            "num_5xx": len(self.server_errors),
            "server_errors": self.server_errors[:20],
            "num_bad_error_shapes": len(self.bad_shapes),
            "bad_error_shapes": self.bad_shapes[:20],
            "num_unexpected_status": len(self.unexpected),
            "unexpected_status": self.unexpected[:20],
        }


# -- hostile requests -----------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
_USER = [{"role": "user", "content": "Hi"}]


@dataclass
class Hostile:
    name: str
    path: str
    body: bytes | dict | list | str | None
    expected: set[int]
    method: str = "POST"
    headers: dict = field(default_factory=dict)


def _chat(**over) -> dict:
    return {"messages": _USER, "max_tokens": 4, **over}


def _comp(**over) -> dict:
    return {"prompt": "Hi", "max_tokens": 4, **over}


def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


def hostile_cases() -> list[Hostile]:
    B = {400}
    cases = [
        # Not JSON, or JSON that is not an object.
        Hostile("invalid JSON", CHAT, b'{"messages": [', B),
        Hostile("empty body", CHAT, b"", B),
        Hostile("JSON array body", CHAT, b"[1, 2, 3]", B),
        Hostile("JSON string body", COMP, b'"hello"', B),
        Hostile("JSON null body", COMP, b"null", B),
        Hostile("trailing garbage", COMP, b'{"prompt": "Hi"} xyz', B),
        Hostile("invalid UTF-8 bytes", COMP, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 4}', B),
        Hostile("lone surrogate escape", COMP, b'{"prompt": "a\\ud800b", "max_tokens": 4}', B),
        Hostile("lone surrogate in chat", CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 4}', B),
        Hostile("lone surrogate in model name", COMP, b'{"prompt": "Hi", "model": "\\ud800"}', B),
        Hostile("lone surrogate in a stop string", COMP, b'{"prompt": "Hi", "stop": ["\\udc00"]}', B),
        Hostile("lone surrogate in logit_bias key", COMP, b'{"prompt": "Hi", "logit_bias": {"\\ud800": 1}}', B),
        Hostile("NUL characters", COMP, _comp(prompt="a\u0000b\u0000"), {200}),
        # Deep nesting (json recursion limits) and huge inputs.
        Hostile("nesting depth 100", CHAT, _nested(100), B),
        Hostile("nesting depth 100000", CHAT, _nested(100_000), B),
        Hostile("nested object depth 50000", COMP, b'{"prompt": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}", B),
        Hostile("1M-character prompt", COMP, _comp(prompt="word " * 200_000), B),
        Hostile("1M-character chat message", CHAT, _chat(messages=[{"role": "user", "content": "x" * 1_000_000}]), B),
        Hostile("100k-character model name", CHAT, _chat(model="m" * 100_000), {404}),
        Hostile("100k token ids", COMP, _comp(prompt=[1] * 100_000), B),
        Hostile("10 MB body", COMP, b'{"prompt": "' + b"a" * (10 << 20) + b'"}', {413}),
        Hostile("10 MB body, chunked", COMP, None, {413}),  # body sent as a generator below
        # NaN / Infinity / out-of-range numbers.
        Hostile("temperature NaN", COMP, b'{"prompt": "Hi", "temperature": NaN}', B),
        Hostile("top_p Infinity", COMP, b'{"prompt": "Hi", "top_p": Infinity}', B),
        Hostile("temperature -Infinity", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": -Infinity}', B),
        Hostile("max_tokens NaN", COMP, b'{"prompt": "Hi", "max_tokens": NaN}', B),
        Hostile("temperature 1e400", COMP, b'{"prompt": "Hi", "temperature": 1e400}', B),
        Hostile("logit_bias NaN", COMP, b'{"prompt": "Hi", "logit_bias": {"5": NaN}}', B),
        Hostile("n = 10^6", CHAT, _chat(n=10**6), B),
        Hostile("n = 0", CHAT, _chat(n=0), B),
        Hostile("max_tokens = 10^9", CHAT, _chat(max_tokens=10**9), B),
        Hostile("max_tokens = 10^30", COMP, _comp(max_tokens=10**30), B),
        Hostile("max_tokens = -1", COMP, _comp(max_tokens=-1), B),
        Hostile("max_tokens = 0", COMP, _comp(max_tokens=0), B),
        Hostile("seed = 2^70", COMP, _comp(seed=2**70), B),
        Hostile("min_tokens > max_tokens", COMP, _comp(min_tokens=10), B),
        Hostile("10,000 stop strings", CHAT, _chat(stop=[f"s{i}" for i in range(10_000)]), B),
        Hostile("empty stop string", CHAT, _chat(stop=[""]), B),
        Hostile("100k-character stop string", COMP, _comp(stop="z" * 100_000), B),
        Hostile("100k stop_token_ids", COMP, _comp(stop_token_ids=list(range(100_000))), B),
        Hostile("negative stop_token_id", COMP, _comp(stop_token_ids=[-3]), B),
        Hostile("negative top_k", CHAT, _chat(top_k=-5), B),
        Hostile("top_p = 0", CHAT, _chat(top_p=0), B),
        Hostile("negative temperature", CHAT, _chat(temperature=-1), B),
        Hostile("top_logprobs = 21", CHAT, _chat(logprobs=True, top_logprobs=21), B),
        Hostile("top_logprobs without logprobs", CHAT, _chat(top_logprobs=3), B),
        Hostile("completions logprobs = 1000", COMP, _comp(logprobs=1000), B),
        Hostile("logit_bias key not a number", COMP, _comp(logit_bias={"abc": 1}), B),
        Hostile("logit_bias key out of vocab", COMP, _comp(logit_bias={"99999999": 1}), B),
        Hostile("logit_bias value 1e9", COMP, _comp(logit_bias={"5": 1e9}), B),
        Hostile("repetition_penalty 0", COMP, _comp(repetition_penalty=0), B),
        # Prompts and messages.
        Hostile("empty messages", CHAT, _chat(messages=[]), B),
        Hostile("messages missing", CHAT, {"max_tokens": 4}, B),
        Hostile("unknown role", CHAT, _chat(messages=[{"role": "wizard", "content": "Hi"}]), B),
        Hostile("role missing", CHAT, _chat(messages=[{"content": "Hi"}]), B),
        Hostile("message not an object", CHAT, _chat(messages=["Hi"]), B),
        Hostile("content a number", CHAT, _chat(messages=[{"role": "user", "content": 5}]), B),
        Hostile("image content part", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]), B),
        Hostile("tool message", CHAT, _chat(messages=[*_USER, {"role": "assistant", "content": None}, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]), {200}),
        Hostile("tools and tool_choice sent", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="auto"), {200}),
        Hostile("null content", CHAT, _chat(messages=[{"role": "user", "content": None}]), {200}),
        Hostile("10,000 messages", CHAT, _chat(messages=[{"role": "user", "content": "hi"}] * 10_000), B),
        Hostile("empty prompt string", COMP, _comp(prompt=""), B),
        Hostile("empty prompt list", COMP, _comp(prompt=[]), B),
        Hostile("empty token list in batch", COMP, _comp(prompt=[[]]), B),
        Hostile("token id -1", COMP, _comp(prompt=[-1, 5]), B),
        Hostile("token id 10^12", COMP, _comp(prompt=[10**12]), B),
        Hostile("token id a float", COMP, _comp(prompt=[1.5, 2]), B),
        Hostile("mixed prompt list", COMP, _comp(prompt=["a", 1]), B),
        Hostile("prompt a dict", COMP, _comp(prompt={"text": "Hi"}), B),
        Hostile("200 prompts in one request", COMP, _comp(prompt=["Hi"] * 200), {200, 400, 429}),
        Hostile("unknown model", COMP, _comp(model="gpt-4"), {404}),
        Hostile("unknown fields", COMP, _comp(frobnicate=True, __proto__={}), {200}),
        Hostile("stream not a bool", COMP, _comp(stream="yes please"), B),
        Hostile("stream_options a string", COMP, _comp(stream=True, stream_options="x"), B),
        # Other routes and methods.
        Hostile("detokenize id -1", "/detokenize", {"tokens": [-1]}, B),
        Hostile("detokenize id 10^20", "/detokenize", {"tokens": [10**20]}, B),
        Hostile("tokenize both prompt and messages", "/tokenize", {"prompt": "a", "messages": _USER}, B),
        Hostile("tokenize neither", "/tokenize", {}, B),
        Hostile("GET a POST route", CHAT, None, {405}, method="GET"),
        Hostile("DELETE /v1/models", "/v1/models", None, {405}, method="DELETE"),
        Hostile("path traversal", "/v1/../../etc/passwd", None, {404}, method="GET"),
        Hostile("unknown route", "/v2/anything", b"{}", {404}),
        Hostile("text/plain content type", COMP, b'{"prompt": "Hi", "max_tokens": 4}', {200, 400}, headers={"content-type": "text/plain"}),
        Hostile("form content type", COMP, b"prompt=Hi", {400}, headers={"content-type": "application/x-www-form-urlencoded"}),
        Hostile("Content-Length lies (short)", COMP, b'{"prompt": "Hi", "max_tokens": 4}', {400}, headers={"content-length": "5"}),
        Hostile("Content-Length lies (long)", COMP, b'{"prompt": "Hi", "max_tokens": 4}', {0, 400}, headers={"content-length": "5000"}),
    ]  # fmt: skip
    # Wrong types everywhere: every request field gets values of the wrong type.
    wrong = [["a", "list"], {"an": "object"}, "a string", 3.5, True, -(2**64)]
    fields = {
        CHAT: [
            "model", "messages", "max_tokens", "max_completion_tokens", "n", "temperature",
            "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "min_tokens",
            "logprobs", "top_logprobs", "stream", "stream_options", "skip_special_tokens",
            "include_stop_str_in_output", "add_generation_prompt", "user",
        ],
        COMP: ["prompt", "max_tokens", "logprobs", "echo", "suffix", "n", "temperature", "stop"],
    }  # fmt: skip
    for path, names in fields.items():
        base = _chat if path == CHAT else _comp
        for name in names:
            for value in wrong:
                cases.append(
                    Hostile(
                        f"{name}={json.dumps(value)[:20]}",
                        path,
                        base(**{name: value}),
                        {200, 400, 404},
                    )
                )
    return cases


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
    return {
        **tally.summary(),
        "num_transport_errors": len(transport_errors),
        "transport_errors": transport_errors[:20],
        "healthy_after": healthy,
        "wall_s": round(time.monotonic() - t0, 1),
    }


# -- schemathesis ---------------------------------------------------------------------------------


def run_schemathesis(
    base_url: str, max_examples: int = 100, seed: int = 0, headers: dict | None = None
) -> dict:
    """Hypothesis-generated requests from /openapi.json: positive (valid by the schema) and
    negative (violating it) cases for every operation."""
    import hypothesis
    import hypothesis.errors
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    raw = httpx.get(base_url + "/openapi.json", headers=headers, timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    per_op: dict[str, dict] = {}
    tally = Tally()
    unsendable, transport_errors = [0], []
    t0 = time.monotonic()

    def send(client: httpx.Client, key: str, case) -> None:
        kw = case.as_transport_kwargs(base_url=base_url)
        drop = ("user-agent", "x-schemathesis-testcaseid")
        try:
            r = client.request(
                kw["method"],
                case.formatted_path,
                params=kw.get("params"),
                headers={
                    k: v for k, v in (kw.get("headers") or {}).items() if k.lower() not in drop
                },
                json=kw.get("json"),
                content=kw.get("data"),
            )
        except httpx.LocalProtocolError:  # e.g. a header value HTTP forbids: never sent
            unsendable[0] += 1
            return
        except httpx.TransportError as e:  # the server dropped the connection
            transport_errors.append(f"{key}: {type(e).__name__}: {e}: {case.as_curl_command()}")
            return
        tally.record(f"{key}: {case.as_curl_command()[:300]}", r.status_code, r.content)

    def fuzz(client: httpx.Client, op, mode) -> None:
        key = f"{op.method.upper()} {op.path} {mode.value}"
        before = tally.cases
        config = settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        test = given(case=op.as_strategy(generation_mode=mode))(
            lambda case: send(client, key, case)
        )
        start = time.monotonic()
        try:
            hypothesis.seed(seed)(config(test))()
        except hypothesis.errors.Unsatisfiable:
            pass  # no request can violate a schema without parameters (GET /v1/models)
        per_op[key] = {"cases": tally.cases - before, "wall_s": round(time.monotonic() - start, 1)}

    with httpx.Client(base_url=base_url, timeout=120, headers=headers) as client:
        for result in schema.get_all_operations():
            for mode in schemathesis.GenerationMode:
                fuzz(client, result.ok(), mode)
        healthy = client.get("/health").status_code == 200
    return {
        **tally.summary(),
        "operations": per_op,
        "unsendable_cases": unsendable[0],
        "num_transport_errors": len(transport_errors),
        "transport_errors": transport_errors[:20],
        "max_examples": max_examples,
        "seed": seed,
        "healthy_after": healthy,
        "wall_s": round(time.monotonic() - t0, 1),
    }


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


# -- CLI ------------------------------------------------------------------------------------------


def fuzz_model_dir() -> Path:
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


def main(argv: list[str] | None = None) -> int:
    from soak import start_server, wait_idle

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-examples", type=int, default=300, help="per operation and mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "fuzz.json"))
    args = p.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    server = start_server(server_args(fuzz_model_dir()), Path(args.out).parent / "fuzz_server.log")
    try:
        hostile = run_hostile(server.base_url)
        hostile["failures"] = fuzz_failures(hostile)
        st = run_schemathesis(server.base_url, args.max_examples, args.seed)
        st["failures"] = fuzz_failures(st)
        idle = wait_idle(server.base_url)
    finally:
        code = server.stop()
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hostile": hostile,
        "schemathesis": st,
        "after": idle,
        "server_exit_code": code,
        "traceback_in_server_log": "Traceback" in server.log(),
        "machine": machine_info(),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 1 if hostile["failures"] or st["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
