"""OpenAI's Predicted Outputs over HTTP (the official client): the same answer with the
prediction, usage's accepted / rejected prediction tokens, a 400 for a malformed one."""

from __future__ import annotations

import httpx
import openai

from tests.support.api import MODEL, assert_error


def test_the_api_takes_a_prediction_and_reports_its_usage(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}],
           "max_tokens": 30, "temperature": 0}  # fmt: skip
    first = client.chat.completions.create(**ask)
    text = first.choices[0].message.content
    assert first.usage.completion_tokens_details is None  # no prediction, no counts
    again = client.chat.completions.create(**ask, prediction={"type": "content", "content": text})
    assert again.choices[0].message.content == text
    details = again.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    edited = client.chat.completions.create(
        **ask, prediction={"type": "content", "content": "Purple, orange and teal. " + text}
    )
    assert edited.choices[0].message.content == text
    assert edited.usage.completion_tokens_details.rejected_prediction_tokens > 0
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        body = {"messages": ask["messages"], "max_tokens": 5}
        for bad in ({"type": "text", "content": "x"}, {"type": "content", "content": ""}, "x"):
            assert_error(c.post("/v1/chat/completions", json={**body, "prediction": bad}), 400)
        r = c.post("/v1/chat/completions",
                   json={**body, "n": 2, "prediction": {"type": "content", "content": "x"}})  # fmt: skip
        assert_error(r, 400, "prediction")
        done = c.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 8,
                      "temperature": 0, "prediction": {"type": "content", "content": " a time"}})  # fmt: skip
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens_details"]
