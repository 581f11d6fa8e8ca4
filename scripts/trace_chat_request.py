"""Issue 38's check of a chat request's walk through the server: which tinyserve.entrypoints
module calls which while one non-streamed chat request is served (tests/support/walk.py), on
a FakeEngine server (no model). python scripts/trace_chat_request.py [--stream]"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import AutoTokenizer

from tests.support.walk import walk
from tinyserve.models.default_model import default_gguf_path, tokenizer_dir_for

tok = AutoTokenizer.from_pretrained(str(tokenizer_dir_for(default_gguf_path())))
body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
status, w = walk(tok, "/v1/chat/completions", body, stream="--stream" in sys.argv)
print("status", status)
print("modules entered:", " -> ".join(w.entered))
print("arrows (caller -> callee: calls):")
for (a, b), n in sorted(w.arrows.items()):
    print(f"  {a} -> {b}: {n}")
print("serving modules, first entries in order:", " -> ".join(w.serving_order()))
print("arrows between serving modules:", sorted(w.arrows_between_serving()))
