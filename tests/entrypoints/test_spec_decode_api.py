"""Speculative decoding behind the HTTP API (a real server, the official SDK): greedy answers
equal those of a server without it, streamed deltas add up to the same text and usage, and
/metrics carries vLLM's spec_decode counters."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.api import MODEL
from tinyserve.config import ServerConfig
from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.testing.server import serve

pytestmark = pytest.mark.slow

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                   "prompt_lookup_min": 2})  # fmt: skip
PASSAGE = (
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fib(i) for i in range(10)])\n"
)


@pytest.fixture(scope="module")
def spec_server(smollm2_gguf_path):
    engine = LLMEngine(EngineArgs(kv_cache_memory="256MiB", speculative_config=SPEC))
    with serve(AsyncEngine(engine), ServerConfig()) as s:
        yield s


def _ask(base_url: str, stream: bool, **kw):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x")
    messages = [{"role": "user", "content": f"Repeat this code exactly:\n\n{PASSAGE}"}]
    args = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 80, **kw}
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, finish, chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("kw", [{}, {"stop": ["range"]}, {"max_tokens": 23}])
def test_answers_equal_a_server_without_speculation(server, spec_server, kw):
    plain = _ask(server.base_url, stream=False, **kw)
    assert _ask(spec_server.base_url, stream=False, **kw) == plain
    assert _ask(spec_server.base_url, stream=True, **kw) == plain


def test_metrics_count_drafts_and_accepted_tokens(spec_server):
    _ask(spec_server.base_url, stream=False)
    text = httpx.get(spec_server.base_url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("tinyserve:spec_decode") and "_created" not in line:
            name, v = line.rsplit(" ", 1)
            values[name] = float(v)
    drafts = values[f'tinyserve:spec_decode_num_drafts_total{{model_name="{MODEL}"}}']
    proposed = values[f'tinyserve:spec_decode_num_draft_tokens_total{{model_name="{MODEL}"}}']
    accepted = values[f'tinyserve:spec_decode_num_accepted_tokens_total{{model_name="{MODEL}"}}']
    first = values[
        f'tinyserve:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{MODEL}",position="0"}}'
    ]
    assert drafts > 0 and 0 < accepted <= proposed and 0 < first <= drafts
