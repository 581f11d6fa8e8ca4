"""The OpenAI-compatible wire format (pydantic, the HTTP edge only). Request models declare
the fields tinyserve honours (the others: request_fields.py); value ranges are checked once,
by SamplingParams, so that the HTTP server and the offline API give the same messages."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from tinyserve.entrypoints.protocol_base import _Request, _Response
from tinyserve.entrypoints.tools import FunctionCall, NamedToolChoice, Tool, ToolCall

# -- errors ------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class OpenAIError(Exception):
    """An error with its HTTP status and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return {"error": info.model_dump()}

    def response(self) -> JSONResponse:
        return _AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message that quotes odd input always encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


_PARAM_RE = re.compile(r"^([a-z_]+(?:\.[a-z_]+)*)\b")
_PARAM_NAMES = {
    "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "min_tokens", "tokens",
    "prompt_logprobs", "cache_salt", "response_format", "structured_outputs", "tools",
    "tool_choice", "text.format", "prediction", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_whitespace_pattern", "json_schema", "grammar",
}  # fmt: skip


def in_own_words(e: OpenAIError, max_tokens: str | None, prompt: str | None) -> OpenAIError:
    """A 400 of the shared steps in an API's own words: ``max_tokens`` wherever it is named
    (also in "min_tokens (50) must be <= max_tokens (10)"), and a prompt too long for the
    context (the engine's "prompt: N tokens ...") as the field the request sent."""
    if max_tokens is not None:
        e.param = max_tokens if e.param == "max_tokens" else e.param
        e.message = re.sub(r"\bmax_tokens\b", max_tokens, e.message)
    if prompt is not None and e.param == "prompt" and re.match(r"prompt: \d+ tokens", e.message):
        e.param, e.message = prompt, prompt + e.message[len("prompt") :]
    return e


def bad_request(e: Exception | str, param: str | None = None) -> OpenAIError:
    message = str(e)
    if param is None:
        m = _PARAM_RE.match(message)
        param = m.group(1) if m and m.group(1) in _PARAM_NAMES else None
    return OpenAIError(400, message, param=param, code="invalid_value")


# -- shared request fields ---------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage on every chunk


def _range(description: str | None = None, **bounds: float) -> dict[str, Any]:
    """Document a value range in the OpenAPI schema without enforcing it in pydantic: the
    check (and its message) stays in SamplingParams, shared with the offline API."""
    return {"description": description, "json_schema_extra": bounds}


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama.cpp's, on json_object


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs``: one mode, and its JSON options (structured_options.py)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON with no whitespace at all
    whitespace_pattern: str | None = None  # the regex of JSON's whitespace between tokens
    disable_additional_properties: bool = False  # objects take their declared properties only
    disable_fallback: bool = False  # one grammar library here: nothing to fall back from
    structural_tag: Any = None  # a 400: not supported


# vLLM's older keys and llama.cpp server's, sent by many clients: structured_outputs' aliases.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern",
          "json_schema": "json", "grammar": "grammar"}  # fmt: skip


class _SamplingFields(_Request):
    """Fields shared by chat and completions; None means "the default". Fields no model
    declares are kept (``model_extra``) for request_fields.py to accept, log or refuse."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _guided_aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(k in data for k in GUIDED):
            return data
        data, sent = dict(data), [k for k in GUIDED if data.get(k) is not None]
        guided = {GUIDED[k]: data.pop(k) for k in list(data) if k in GUIDED}
        guided = {k: v for k, v in guided.items() if v is not None}
        kinds = [k for k in guided if k != "whitespace_pattern"]  # (an option, not a kind)
        if guided and data.get("structured_outputs") is not None:
            raise ValueError(f"{sent[0]}: an alias of structured_outputs, which the request "
                             "sends too; send one of them")  # fmt: skip
        if len(kinds) > 1:  # (was named structured_outputs, which the client did not send)
            raise ValueError(f"{sent[0]}: {', '.join(sent)} are aliases of structured_outputs, "
                             "each a constraint; send one")  # fmt: skip
        if guided:
            data["structured_outputs"] = guided
        return data

    model: str | None = Field(None, description="The served model name (optional: default model)")
    n: int = Field(1, **_range("Choices to generate for each prompt", minimum=1, maximum=16))
    temperature: float | None = Field(None, **_range("0 = greedy (default 1.0)", minimum=0))
    top_p: float | None = Field(None, **_range(exclusiveMinimum=0, maximum=1))
    top_k: int | None = Field(None, **_range("-1 or 0 disables top-k", minimum=-1))
    min_p: float | None = Field(None, **_range(minimum=0, maximum=1))
    seed: int | None = Field(None, **_range(minimum=-(2**63), maximum=2**63 - 1))
    stop: str | list[str] | None = Field(
        None, description="Up to 64 non-empty strings of at most 512 characters"
    )
    stop_token_ids: list[StrictInt] | None = None  # strict: true is not token 1
    presence_penalty: float | None = Field(None, **_range(minimum=-2, maximum=2))
    frequency_penalty: float | None = Field(None, **_range(minimum=-2, maximum=2))
    repetition_penalty: float | None = Field(None, **_range(exclusiveMinimum=0, maximum=10))
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100]"
    )
    ignore_eos: bool = False
    min_tokens: int = Field(0, **_range(minimum=0))
    prompt_logprobs: int | None = Field(
        None,
        **_range("vLLM's: each prompt token's logprob and the top alternatives", minimum=0,
                 maximum=20),
    )  # fmt: skip
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


# -- chat ----------------------------------------------------------------------------------------


class TextContentPart(_Request):
    type: Literal["text"] = "text"
    text: str


_SALT = "Requests with different salts share no prefix-cache blocks nor suffix-decoding drafts"


class Prediction(_Request):  # OpenAI's Predicted Outputs (entrypoints/prediction.py)
    type: Literal["content"]
    content: str | list[TextContentPart]


class _PastCall(_Request, FunctionCall):
    """A past call as a request sends it: its strings checked (a lone surrogate is the field's
    400; the call goes into the prompt as sent, tools.written_call)."""


class PastToolCall(_Request, ToolCall):
    function: _PastCall

    @model_validator(mode="before")
    @classmethod
    def _from_call(cls, data: Any) -> Any:  # a call made here (tools.ToolCall), checked too
        return data.model_dump() if isinstance(data, ToolCall) else data


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[PastToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking (the template's call)

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        """A user, system or developer turn needs ``content`` (OpenAI's rule): a user turn
        without it was rendered as an empty one. (Assistant turns with calls have none; a
        tool result without it is taken as empty, as vLLM does.)"""
        if self.content is None and self.role not in ("assistant", "tool"):
            raise ValueError(f"content: required in a {self.role!r} message")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, **_range("Deprecated alias of max_completion_tokens", minimum=1)
    )
    max_completion_tokens: int | None = Field(
        None, **_range("Default: whatever room the context window leaves (as vLLM)", minimum=1)
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, **_range("Needs logprobs=true", minimum=0, maximum=20))
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    prediction: Prediction | None = None
    cache_salt: str | None = Field(None, description=_SALT)
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template, e.g. enable_thinking"
    )


class ChatLogprobTop(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the <think> block (entrypoints/reasoning.py)
    tool_calls: list[ToolCall] | None = None


# vLLM's ``prompt_logprobs``: per prompt token (None for the first), token id -> its entry.
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: dict[str, int] | None = None  # with a prediction


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


# -- completions ---------------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        ..., description="Text, a list of texts, token ids or a list of token-id lists"
    )
    prediction: Prediction | None = None
    cache_salt: str | None = Field(None, description=_SALT)
    max_tokens: int | None = Field(
        16, **_range("Default 16, as OpenAI and vLLM; 0 with echo scores the prompt", minimum=0)
    )
    logprobs: int | None = Field(
        None, **_range("Top alternatives per token", minimum=0, maximum=20)
    )
    echo: bool = False
    suffix: str | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tinyserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
