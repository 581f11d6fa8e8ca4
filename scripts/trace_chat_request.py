"""Issue 38's check of a chat request's walk through the server: the tinyserve.entrypoints
modules one non-streamed chat request's Python calls enter, in order (consecutive calls in
one module collapsed), on a FakeEngine server (no model). python scripts/trace_chat_request.py"""

import sys
import threading
from collections import Counter

import httpx

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from transformers import AutoTokenizer

from tests.support.fake_engine import FakeEngine
from tinyserve.config import ServerConfig
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.models.default_model import default_gguf_path, tokenizer_dir_for
from tinyserve.testing.server import serve

tok = AutoTokenizer.from_pretrained(str(tokenizer_dir_for(default_gguf_path())))
seq = []
on = [False]


def prof(frame, event, arg):
    if event != "call" or not on[0]:
        return
    mod = frame.f_globals.get("__name__", "")
    if mod.startswith("tinyserve.entrypoints") and (not seq or seq[-1] != mod):
        seq.append(mod)


threading.setprofile(prof)
with serve(AsyncEngine(FakeEngine(tokenizer=tok), max_queued_requests=4), ServerConfig()) as s:
    with httpx.Client(base_url=s.base_url) as c:
        c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        on[0] = True
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        on[0] = False
print(r.status_code)
short = [m.replace("tinyserve.entrypoints.", "") for m in seq]
print(" -> ".join(short))
print(Counter(short))
