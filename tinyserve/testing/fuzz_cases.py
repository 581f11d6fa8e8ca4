"""The hand-written hostile requests of the HTTP fuzzer (tinyserve.testing.fuzz): malformed
and huge bodies, out-of-range numbers, odd prompts and messages, other routes and methods,
and every request field with values of the wrong type."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
_USER = [{"role": "user", "content": "Hi"}]
B = {400}


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


def _malformed_cases() -> list[Hostile]:
    """Not JSON, JSON that is not an object, deep nesting and huge inputs."""
    return [
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
    ]  # fmt: skip


def _number_cases() -> list[Hostile]:
    """NaN / Infinity / out-of-range numbers."""
    return [
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
    ]  # fmt: skip


def _message_cases() -> list[Hostile]:
    """Prompts and messages."""
    return [
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
        Hostile("null content", CHAT, _chat(messages=[{"role": "user", "content": None}]), B),  # OpenAI: required
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
    ]  # fmt: skip


def _route_cases() -> list[Hostile]:
    """Other routes and methods."""
    return [
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


def _wrong_type_cases() -> list[Hostile]:
    cases = []
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


def hostile_cases() -> list[Hostile]:
    return [
        *_malformed_cases(),
        *_number_cases(),
        *_message_cases(),
        *_route_cases(),
        *_wrong_type_cases(),
    ]
