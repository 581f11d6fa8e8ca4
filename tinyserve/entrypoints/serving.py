"""The base of every API handler: the steps every API shares, as methods its class calls.

Each API's class (serving_chat.py, serving_completion.py, serving_responses.py,
serving_messages.py, serving_tokens.py) drives its own request in ``create``:
``check_request`` -> its own ``prepare`` (validate, SamplingParams, prompt ids: a ``Job``) ->
``submit`` (log, compile the grammar off the loop, add to the engine) -> stream (``sse`` of
its own chunks, framed by streaming.ChunkFrame for the OpenAI APIs) or ``collect`` and its
own ``response``. The arrows point one way: an API's class calls down into this base, never
back (tests/entrypoints/test_serving_walk.py). Shared here: the tokenizer and chat template,
the common sampling fields, a response format as a grammar (``format_constraint``), the
rules between a format, ``structured_outputs`` and tools (``constraint``), tool grammars and
parsers, token strings for logprobs. Large inputs are templated off the loop (off_loop).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tinyserve.engine.client import EngineClient, EngineDeadError, OutputStream, QueueFullError
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints import protocol_logprobs as L
from tinyserve.entrypoints import reasoning as R
from tinyserve.entrypoints import tool_stream as TS
from tinyserve.entrypoints import tools as T
from tinyserve.entrypoints.chat_template import render_chat
from tinyserve.entrypoints.prediction import prediction_ids
from tinyserve.entrypoints.protocol import OpenAIError, bad_request
from tinyserve.entrypoints.request_fields import check_extra_fields
from tinyserve.entrypoints.streaming import (
    ChunkFrame,
    collect,
    engine_error,
    sse,
    until_disconnect,
)
from tinyserve.entrypoints.structured_options import (
    PRETTY,
    json_answer_schema,
    structured_outputs_field,
    with_json_options,
)
from tinyserve.entrypoints.tool_formats import calls_check, tool_format
from tinyserve.entrypoints.tool_stream_marked import MarkedStream, collect_calls
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams
from tinyserve.structured.strict import closed_objects

ToolStream = TS.HermesStream | TS.EnvelopeStream | MarkedStream | TS.StopAtText

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """One request between ``prepare`` and its answer. APIs subclass it for their own state."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    continuous_usage: bool = False  # and vLLM's continuous_usage_stats: usage on every chunk
    tools: list[T.Tool] = field(default_factory=list)
    json_answer: bool = False  # tools with a JSON response format: the answer without calls
    format_check: StructuredOutputsParams | None = None  # a format beside tools: see submit
    # With tools, the stop strings match the answer's text, not the raw output (its wrapper):
    # they leave the engine's params for the tool parser (tool_stream.StopAtText).
    stops: tuple[str, ...] = ()
    # Streamed: a choice its text's stop string ended -> its output tokens up to the stop
    # (tool_stream.feed_step; the engine counts what ran on until the abort).
    stop_counts: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tools and self.params.stop:
            self.stops, self.params.stop = tuple(self.params.stop), []

    def answered(self) -> bool:  # every choice ended by a stop string of its text: abort
        return False


class OpenAIServing:
    """The shared steps, called by each API's class; none of them calls back into it."""

    def __init__(
        self,
        async_engine: EngineClient,
        model_name: str,
        shutdown_grace_period: float = 30.0,
        log_requests: bool = False,
        open_tool_arguments: bool = False,
        reasoning_parser: str = "auto",
        json_pretty: bool = False,
    ) -> None:
        self.engine = async_engine
        # JSON answers' layout where a request names none (--json-pretty; structured_options)
        self.json_layout = PRETTY if json_pretty else None
        self.reasoning_parser = reasoning_parser  # entrypoints/reasoning.py
        # Tool arguments may hold properties their schema does not declare (--open-tool-arguments;
        # by default OpenAI's strict semantics: tools.closed_objects).
        self.open_tool_arguments = open_tool_arguments
        self.model_name = model_name
        # Prompts and bodies reach the log only when asked (--log-requests): they are user data.
        self.log_requests = log_requests
        # On SIGTERM, streams in flight get this long to finish (then they are cut).
        self.shutdown_grace_period = shutdown_grace_period
        self._token_str_cache: dict[int, str] = {}

    # -- the shared steps ---------------------------------------------------------------------

    def check_request(self, req: Any) -> None:
        """The model it names (a 404) and fields no handler reads (request_fields.py)."""
        self.check_model(req.model)
        check_extra_fields(req)

    async def submit(self, job: Job, req: Any) -> OutputStream:
        """Log the request (when asked), compile its grammar off the loop and add it to the
        engine; errors map to HTTP."""
        if self.log_requests:
            logger.info("request %s: %s", job.request_id, req.model_dump_json(exclude_none=True))
        try:  # a format beside tools alone first: its errors name it, not "tools" (and a
            if job.format_check is not None:  # forced call's later answer's is checked too)
                await self.engine.prepare(SamplingParams(structured_outputs=job.format_check))
            await self.engine.prepare(job.params)
            return self.engine.add_request(job.request_id, job.prompts, job.params)
        except ValueError as e:
            raise bad_request(e) from None
        except (QueueFullError, EngineDeadError) as e:
            raise engine_error(e) from None

    async def collect(self, raw: Request, stream: OutputStream, job: Job | None = None):
        """The whole answer (choices, usage); the request is aborted if the client goes away
        first, or once stop strings of its text (``job.stops``) have ended every choice."""
        answered = None  # (not where a <think> block comes first: chat's thinks, responses')
        thinks = getattr(job, "thinks", False) or getattr(job, "splitter", None) is not None
        if job is not None and job.stops and not thinks:
            choices = job.params.n * len(job.prompts)
            answered = TS.AllStopped(partial(self.tool_stream, job), choices)
        return await until_disconnect(raw, collect(stream, answered), stream)

    def sse(self, events: AsyncIterator[dict[str, Any]], typed: bool = False) -> Response:
        """A ``text/event-stream`` of ``events``; on SIGTERM it gets the grace period."""
        return sse(events, self.shutdown_grace_period, typed=typed)

    def chunk_frame(self, job: Job, chunk_object: str) -> ChunkFrame:
        """The frame of an OpenAI stream (streaming.ChunkFrame) for ``job``."""
        return ChunkFrame.start(job, chunk_object, self.model_name)

    # -- inputs --------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        tok = self.engine.tokenizer
        if tok is None:
            raise OpenAIError(400, "this server has no tokenizer: send token ids", param="prompt")
        return tok

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist (this server serves `{self.model_name}`)",
                "not_found_error",
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt_ids(self, messages, add_generation_prompt=True, tools=None, tool_choice=None,
                        template_kwargs=None, continue_final=False) -> list[int]:  # fmt: skip
        """The conversation through the tokenizer's chat template (chat_template.py)."""
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools or [],
                           tool_choice, template_kwargs, continue_final)  # fmt: skip

    def sampling_params(
        self, req: P._SamplingFields, scores: bool = False, **extra: Any
    ) -> SamplingParams:
        """The sampling fields every API shares, plus the API's own (``extra``). ``max_tokens``
        0 (scoring the prompt) only where the answer has something to show for it: prompt
        logprobs, or (``scores``) the echoed prompt."""
        if getattr(req, "stream_options", None) is not None and not req.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        kwargs: dict[str, Any] = {
            "n": req.n,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "seed": req.seed,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty,
            "logit_bias": req.logit_bias,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
            "min_tokens": req.min_tokens,
            "prompt_logprobs": req.prompt_logprobs,
            "skip_special_tokens": req.skip_special_tokens,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "prediction": prediction_ids(req, self.tokenizer),
            # Declared by chat and completions only; elsewhere an extra field (check_extra_fields)
            "cache_salt": req.cache_salt if "cache_salt" in type(req).model_fields else None,
            **extra,
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"}
        if kwargs["max_tokens"] == 0 and not scores and kwargs.get("prompt_logprobs") is None:
            raise bad_request(
                "max_tokens: must be >= 1 (0 scores the prompt: with echo or prompt_logprobs)",
                "max_tokens",
            )
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise bad_request(e) from None

    # -- what the output must match ------------------------------------------------------------

    def constraint(
        self,
        req: P._SamplingFields,
        fmt: StructuredOutputsParams | None,
        fmt_field: str,
        tools: list[T.Tool],
        tool_choice: T.ToolChoice | None = None,
        parallel_tool_calls: bool = True,
    ) -> StructuredOutputsParams | None:
        """The request's one constraint: its response format (``fmt``, from the API's field
        ``fmt_field``), vLLM's ``structured_outputs``, or the tools' grammar — a 400 when it
        asks for two. Tools with a JSON response format (as the OpenAI Agents SDK sends an
        agent's output type): under ``auto`` the answer that is not a call is that JSON;
        a call is forced otherwise, and the format is for a later answer."""
        so = structured_outputs_field(req.structured_outputs)
        if fmt is not None and so is not None:
            raise bad_request(
                f"structured_outputs: give {fmt_field} or structured_outputs, not both",
                "structured_outputs",
            )
        if not tools:
            return with_json_options(fmt or so, req.structured_outputs, self.json_layout)
        if so is not None or req.structured_outputs is not None:  # nor its JSON options
            raise bad_request("tools: cannot be combined with structured_outputs", "tools")
        answer = json_answer_schema(fmt) if answers_json(tools, fmt, tool_choice) else None
        return self.tools_constraint(tools, tool_choice, parallel_tool_calls, answer)

    def tools_constraint(
        self,
        tools: list[T.Tool],
        tool_choice: T.ToolChoice | None,
        parallel_tool_calls: bool,
        answer: dict | None = None,
    ) -> StructuredOutputsParams:
        """The grammar of the tools' calls (and, with ``auto``, of text instead: of the JSON
        schema ``answer`` where one is given)."""
        fmt, open_args = tool_format(self.tokenizer), self.open_tool_arguments
        try:  # a schema too deep or too large (utils/grammar_size) is the client's: a 400
            if fmt is not None:  # the calls in the template's own format (tool_formats.py)
                grammar = fmt.grammar(tools, tool_choice, parallel_tool_calls, open_args, answer)
                check = calls_check(fmt, tools, open_args, answer)
                return StructuredOutputsParams(grammar=grammar, field="tools", answer_check=check)
            schema = T.envelope_schema(tools, tool_choice, parallel_tool_calls, open_args, answer)
            return StructuredOutputsParams(json=schema, field="tools")
        except ValueError as e:
            raise bad_request(e, "tools") from None

    @staticmethod
    def checked_tools(tools: list[T.Tool] | None, choice: T.ToolChoice | None) -> list[T.Tool]:
        """The tools the model may call (tools.check_tools); bad ones are a 400."""
        try:
            return T.check_tools(tools, choice)
        except ValueError as e:
            raise bad_request(e, "tool_choice" if "tool_choice" in str(e) else "tools") from None

    def parse_tools(self, text: str, job: Job) -> tuple[str | None, list]:
        """A whole answer's content and calls (beside a JSON answer, ``Job.json_answer``,
        read as that or calls)."""
        fmt = tool_format(self.tokenizer)
        if fmt is None:
            return T.parse_output(text, job.json_answer)
        return fmt.parse(text, _answer_names(job))

    def answer_tools(
        self,
        job: Job,
        text: str,
        finish: str | None,
        stop_reason: int | str | None = None,
        unarmed: int = 0,
    ) -> tuple[str | None, list, str | None, int | str | None]:
        """Content, calls, the finish reason (``tool_calls`` where calls end it) and the stop
        reason (a stop string of the text, Job.stops, where one ended it; not in the first
        ``unarmed`` characters, before min_tokens: Choice.unarmed): parsed whole when the
        answer ended; as the stream parser sent them when cut (by max_tokens, a stop string
        or a stop token): a cut call stays a call, and the envelope's text its content,
        never the raw wrapper."""
        if not job.tools or finish not in ("stop", "length"):
            return text, [], finish, stop_reason
        if finish == "stop" and stop_reason is None and not job.stops:
            content, calls = self.parse_tools(text, job)
            return content, calls, "tool_calls" if calls else finish, None
        parser = self.tool_stream(job)
        events = TS.feed(parser, text, unarmed)
        events += parser.finish(finish)
        return *collect_calls(events), events[-1][1], TS.visible_stop(parser) or stop_reason

    def tool_stream(self, job: Job) -> ToolStream:
        """A parser of the streamed answer, the counterpart of ``parse_tools`` (behind the
        job's stop strings, if any)."""
        fmt, names = tool_format(self.tokenizer), _answer_names(job)
        parser = TS.EnvelopeStream(job.json_answer) if fmt is None else fmt.stream(names)
        if job.stops:
            return TS.StopAtText(parser, job.stops, job.params.include_stop_str_in_output)
        return parser

    def tool_decoding(self, tools: list[T.Tool]) -> dict[str, Any]:
        """Sampling settings the tools' format needs: its marker is a special token that
        the parser must see."""
        fmt = tool_format(self.tokenizer) if tools else None
        return {"skip_special_tokens": False} if fmt and fmt.keeps_special_tokens else {}

    # -- answers --------------------------------------------------------------------------------

    def thinks(self, template_kwargs: dict[str, Any] | None) -> bool:
        """Whether this chat answer's <think> block is split off (reasoning.py)."""
        if (template_kwargs or {}).get(
            "enable_thinking"
        ) is False or self.reasoning_parser == "none":
            return False
        return self.reasoning_parser == "think" or R.template_thinks(self.tokenizer)

    def token_str(self, token_id: int) -> str:
        """A token's text, for logprobs."""
        s = self._token_str_cache.get(token_id)
        if s is None:
            tok = self.engine.tokenizer
            s = L.token_text(tok, token_id) if tok is not None else str(token_id)
            if len(self._token_str_cache) < 200_000:
                self._token_str_cache[token_id] = s
        return s

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes, for chat logprobs (protocol_logprobs.token_bytes)."""
        tok = self.engine.tokenizer
        text = self.token_str(token_id)
        return L.token_bytes(tok, token_id, text) if tok is not None else text.encode("utf-8")


def _answer_names(job: Job) -> list[str] | None:
    """The tools' names where a JSON answer may stand instead of calls (a format's reader
    tells the two apart by them), else None."""
    return [t.function.name for t in job.tools] if job.json_answer else None


def answers_json(tools: list, fmt: StructuredOutputsParams | None, choice) -> bool:
    """Whether an answer without calls is a response format's JSON (``Job.json_answer``)."""
    return bool(tools) and fmt is not None and choice in (None, "auto")


def format_constraint(
    kind: str | None,
    schema: dict[str, Any] | None,
    field: str,
    schema_field: str,
    strict: bool | None = None,
) -> StructuredOutputsParams | None:
    """A response format as a grammar: chat's ``response_format`` and the Responses API's
    ``text.format`` (``field`` and ``schema_field`` name them in errors). Objects take only
    their declared properties (closed_objects: OpenAI's strict mode, and what vLLM's and
    llama.cpp's grammars do by default) unless ``strict`` is False: then as written."""
    if kind is None or kind == "text":
        return None
    if kind == "json_schema" and schema is None:
        raise bad_request(f"{schema_field}: json_schema needs a schema", schema_field)
    try:
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True, field=field)
        return StructuredOutputsParams(json=schema if strict is False else closed_objects(schema),
                                       field=field)  # fmt: skip
    except ValueError as e:
        raise bad_request(e, field) from None


def response_format(req: P._SamplingFields) -> StructuredOutputsParams | None:
    """Chat's and completions' ``response_format`` as a grammar."""
    fmt = req.response_format
    schema = fmt.json_schema.schema_ if fmt is not None and fmt.json_schema else None
    strict = fmt.json_schema.strict if fmt is not None and fmt.json_schema else None
    kind = fmt.type if fmt else None
    if kind == "json_object" and fmt.schema_ is not None:  # llama.cpp's server's form
        kind, schema = "json_schema", fmt.schema_
    return format_constraint(kind, schema, "response_format", "response_format.json_schema.schema",
                             strict)  # fmt: skip
