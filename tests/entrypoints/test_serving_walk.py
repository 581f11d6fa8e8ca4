"""Issue 38: a request's path through the serving modules goes one way — the route, then its
API's class (serving_chat.py, ...), then the shared steps (serving.py) — and the base never
calls back into an API's class. Traced call by call on a FakeEngine server
(tests/support/walk.py; scripts/trace_chat_request.py prints the same for a chat request)."""

from __future__ import annotations

import pytest

from tests.support.walk import walk

CASES = {
    "chat": ("/v1/chat/completions", "serving_chat", True,
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    "completions": ("/v1/completions", "serving_completion", True,
                    {"prompt": "hi", "max_tokens": 3, "echo": True}),
    "responses": ("/v1/responses", "serving_responses", False,
                  {"input": "hi", "max_output_tokens": 3}),
    "messages": ("/v1/messages", "serving_messages", False,
                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
@pytest.mark.parametrize("api", sorted(CASES))
def test_serving_modules_are_entered_once_in_order(smollm2_tokenizer, api, stream):
    path, module, via_api_server, body = CASES[api]
    status, w = walk(smollm2_tokenizer, path, body, stream=stream)
    assert status == 200
    route = ["api_server"] if via_api_server else []
    assert w.serving_order() == [*route, module, "serving"], w.entered
    # Down only: no arrow from the shared steps back into an API's class (template-method
    # hooks), and none between two APIs.
    expected = {(module, "serving")} | ({("api_server", module)} if via_api_server else set())
    assert w.arrows_between_serving() == expected, w.arrows
