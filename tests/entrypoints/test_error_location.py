"""How a request's validation error names its param (protocol_base.error_location): a
union's branches are left out (``str``, ``list[...]``, ``literal[...]``, a model class's
name, a tagged union's tag), a dict's keys are not — they were dropped when capitalised or
holding a hyphen (``metadata.User`` was named ``metadata``)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints.protocol_anthropic import MessagesRequest
from tinyserve.entrypoints.protocol_base import error_messages
from tinyserve.entrypoints.protocol_responses import ResponsesRequest

USER = {"role": "user", "content": "hi"}
CASES = [
    (ResponsesRequest, {"input": "hi", "metadata": {"User": 5}}, "metadata.User"),
    (ResponsesRequest, {"input": "hi", "metadata": {"user-id": 5}}, "metadata.user-id"),
    (ResponsesRequest, {"input": "hi", "metadata": {"list[x]y": 5}}, "metadata.list[x]y"),
    (P.ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (P.ChatCompletionRequest, {"messages": [USER], "tool_choice": {"type": "function"}},
     "tool_choice.function"),
    (P.ChatCompletionRequest, {"messages": [USER], "tool_choice": "some"}, "tool_choice"),
    (MessagesRequest, {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    (MessagesRequest, {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": 5}]}]}, "messages[0].content[0].input"),
]  # fmt: skip


class User(BaseModel):  # a model of the process's that is not a request's: not a branch
    name: str


@pytest.mark.parametrize("model, body, where", CASES)
def test_the_param_named(model, body, where):
    with pytest.raises(ValidationError) as e:
        model.model_validate({"model": "m", **body})
    assert where in [w for w, _ in error_messages(e.value.errors())]
