"""OpenAI request handling: prompt -> token ids -> SamplingParams -> AsyncEngine -> responses.

Chat prompts go through the tokenizer's chat template (with the assistant generation prompt);
completion prompts may be text, token ids or lists of either (one engine request for all of
them; the engine numbers the choices prompt_index * n + sample_index, as OpenAI). Templating
and tokenising of large inputs run in a worker thread, so a megabyte prompt does not stall the
other streams on the event loop. Streams are ``data: {json}`` events ending with
``data: [DONE]``; a failure after streaming began is sent as an ``{"error": ...}`` event
before ``[DONE]``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyserve.engine.client import EngineClient, EngineDeadError, OutputStream, QueueFullError
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints.protocol import OpenAIError, bad_request
from tinyserve.entrypoints.serving_chat import ChatServing
from tinyserve.entrypoints.streaming import (
    collect,
    engine_error,
    finish_reason_of,
    input_size,
    off_loop,
    outputs,
    sse,
    until_disconnect,
    usage_info,
)
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class OpenAIServing(ChatServing):
    """The handlers behind /v1/chat/completions, /v1/completions, /tokenize, /detokenize."""

    def __init__(
        self,
        async_engine: EngineClient,
        model_name: str,
        shutdown_grace_period: float = 30.0,
        log_requests: bool = False,
    ) -> None:
        self.engine = async_engine
        self.model_name = model_name
        # Prompts and bodies reach the log only when asked (--log-requests): they are user data.
        self.log_requests = log_requests
        # On SIGTERM, streams in flight get this long to finish (then they are cut).
        self.shutdown_grace_period = shutdown_grace_period
        self._token_str_cache: dict[int, str] = {}

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

    def completion_prompts(self, prompt: Any) -> list[list[int]]:
        """Normalise a completions ``prompt`` to a list of token-id lists."""
        if isinstance(prompt, str):
            return [self.encode(prompt)]
        if not prompt:
            raise bad_request("prompt: must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            return [self.encode(p) for p in prompt]
        return [list(p) for p in prompt]

    def sampling_params(self, req: P._SamplingFields, **extra: Any) -> SamplingParams:
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
            "skip_special_tokens": req.skip_special_tokens,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "structured_outputs": self.structured_outputs(req),
            **extra,
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"}
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise bad_request(e) from None

    @staticmethod
    def structured_outputs(req: P._SamplingFields) -> StructuredOutputsParams | None:
        """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM), not both."""
        fmt, so = req.response_format, req.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise bad_request(
                "structured_outputs: give response_format or structured_outputs, not both",
                "structured_outputs",
            )
        try:
            if so is not None:
                return StructuredOutputsParams(
                    json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                    json_object=so.json_object,
                )  # fmt: skip
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True, field="response_format")
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format: json_schema needs json_schema.schema")
            return StructuredOutputsParams(json=fmt.json_schema.schema_, field="response_format")
        except ValueError as e:
            param = "structured_outputs" if so is not None else "response_format"
            raise bad_request(e, param) from None

    def _log_request(self, request_id: str, req) -> None:
        if self.log_requests:
            logger.info("request %s: %s", request_id, req.model_dump_json(exclude_none=True))

    async def add(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams
    ) -> OutputStream:
        """Prepare (compile a grammar, off the loop) and add a request; errors map to HTTP."""
        try:
            await self.engine.prepare(params)
            return self.engine.add_request(request_id, prompts, params)
        except ValueError as e:
            raise bad_request(e) from None
        except (QueueFullError, EngineDeadError) as e:
            raise engine_error(e) from None

    # -- logprobs ------------------------------------------------------------------------------

    def token_str(self, token_id: int) -> str:
        s = self._token_str_cache.get(token_id)
        if s is None:
            tok = self.engine.tokenizer
            s = tok.decode([token_id]) if tok is not None else str(token_id)
            if len(self._token_str_cache) < 200_000:
                self._token_str_cache[token_id] = s
        return s

    # -- completions ---------------------------------------------------------------------------

    def _echo_texts(self, prompts: list[list[int]], echo: bool) -> list[str]:
        return [self.tokenizer.decode(p) if echo else "" for p in prompts]

    async def completion(self, req: P.CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix: not supported", "suffix")
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
        size = input_size(req.prompt) if isinstance(req.prompt, str | list) else 0
        prompts = await off_loop(size, self.completion_prompts, req.prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        self._log_request(request_id, req)
        stream = await self.add(request_id, prompts, params)  # validates the token ids
        try:
            echo_texts = await off_loop(size, self._echo_texts, prompts, req.echo)
        except BaseException:
            stream.abort()
            raise
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = self._completion_stream(
                request_id, stream, params, prompts, echo_texts, req.echo, include_usage
            )
            return sse(gen, self.shutdown_grace_period)
        choices, usage = await until_disconnect(raw, collect(stream), stream)
        result_choices = []
        for i, c in enumerate(choices):
            logprobs = None
            if params.logprobs is not None:
                echo_ids = prompts[c.prompt_index] if req.echo else None
                logprobs = P.completion_logprobs(c.logprobs, self.token_str, 0, echo_ids)
            result_choices.append(
                P.CompletionChoice(
                    index=i,
                    text=echo_texts[c.prompt_index] + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        result = P.CompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=result_choices,
            usage=usage_info(usage),
        )
        return JSONResponse(P.dump(result))

    async def _completion_stream(
        self,
        request_id: str,
        stream: OutputStream,
        params: SamplingParams,
        prompts: list[list[int]],
        echo_texts: list[str],
        echo: bool,
        include_usage: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        head = {"id": request_id, "object": "text_completion", "created": int(time.time())}
        head["model"] = self.model_name
        offsets: dict[int, int] = {}  # choice index -> characters sent
        usage = None
        async for out in outputs(stream):
            usage = out.usage or usage
            fr = finish_reason_of(out)
            text, echo_ids = out.text_delta, None
            if echo and out.index not in offsets:  # the choice's first event carries the echo
                text = echo_texts[out.prompt_index] + text
                echo_ids = prompts[out.prompt_index]
            if not text and fr is None and not out.logprobs:
                continue
            offset = offsets.get(out.index, 0)
            logprobs = None
            if params.logprobs is not None:
                logprobs = P.completion_logprobs(out.logprobs, self.token_str, offset, echo_ids)
            offsets[out.index] = offset + len(text)
            choice = {"index": out.index, "text": text, "logprobs": logprobs, "finish_reason": fr}
            yield {**head, "choices": [choice]}
        if include_usage:
            yield {**head, "choices": [], "usage": usage_info(usage).model_dump()}

    # -- tokenize ------------------------------------------------------------------------------

    def tokenize(self, req: P.TokenizeRequest) -> P.TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt: give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt)
        else:
            ids = self.encode(req.prompt or "", req.add_special_tokens)
        return P.TokenizeResponse(
            count=len(ids), max_model_len=self.engine.info.max_model_len, tokens=ids
        )

    def detokenize(self, req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.engine.info.vocab_size
        for t in req.tokens:
            if not 0 <= t < vocab:
                raise bad_request(f"tokens: token id {t} is outside [0, {vocab})", "tokens")
        return P.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
