"""OpenAI request handling: prompt -> token ids -> SamplingParams -> AsyncEngine -> responses.

Chat prompts go through the tokenizer's chat template (with the assistant generation prompt);
completion prompts may be text, token ids or lists of either (one engine request per prompt,
choice index = prompt_index * n + sample_index, as OpenAI). Streams are ``data: {json}``
events ending with ``data: [DONE]``; a failure after streaming began is sent as an
``{"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints.protocol import OpenAIError, bad_request, engine_error
from tinyserve.entrypoints.streaming import (
    Choice,
    collect,
    finish_reason_of,
    merge,
    sse,
    until_disconnect,
    usage,
)
from tinyserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class OpenAIServing:
    """The handlers behind /v1/chat/completions, /v1/completions, /tokenize, /detokenize."""

    def __init__(
        self,
        async_engine: AsyncEngine,
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

    def chat_prompt_ids(
        self, messages: list[P.ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        conversation = []
        for m in messages:
            content = m.content
            if isinstance(content, list):
                content = "\n".join(part.text for part in content)
            conversation.append({"role": m.role, "content": content or ""})
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except OpenAIError:
            raise
        except Exception as e:  # the template rejected the conversation (jinja raise_exception)
            raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

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
            **extra,
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"}
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise bad_request(e) from None

    def _log_request(self, request_id: str, req) -> None:
        if self.log_requests:
            logger.info("request %s: %s", request_id, req.model_dump_json(exclude_none=True))

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        try:
            return self.engine.add_request(request_id, prompt_ids, params)
        except ValueError as e:
            raise bad_request(e) from None
        except (QueueFullError, EngineDeadError) as e:
            raise engine_error(e) from None

    def add_all(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams
    ) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.add(rid, ids, params))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    # -- logprobs ------------------------------------------------------------------------------

    def token_str(self, token_id: int) -> str:
        s = self._token_str_cache.get(token_id)
        if s is None:
            tok = self.engine.tokenizer
            s = tok.decode([token_id]) if tok is not None else str(token_id)
            if len(self._token_str_cache) < 200_000:
                self._token_str_cache[token_id] = s
        return s

    # -- chat ----------------------------------------------------------------------------------

    async def chat(self, req: P.ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs=true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise bad_request(f"top_logprobs: must be in [0, 20], got {req.top_logprobs}")
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        params = self.sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        )
        prompt_ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self._log_request(request_id, req)
        streams = self.add_all(request_id, [prompt_ids], params)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return sse(
                self._chat_stream(request_id, streams, params, len(prompt_ids), include_usage),
                self.shutdown_grace_period,
            )
        choices = await until_disconnect(raw, collect(streams, params.n), streams)
        result = P.ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=[
                P.ChatCompletionChoice(
                    index=i,
                    message=P.ChatResponseMessage(content=c.text),
                    logprobs=P.chat_logprobs(c.logprobs, self.token_str)
                    if params.logprobs is not None
                    else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for i, c in enumerate(choices)
            ],
            usage=usage(len(prompt_ids), choices),
        )
        return JSONResponse(P.dump(result))

    async def _chat_stream(
        self,
        request_id: str,
        streams: list[RequestStream],
        params: SamplingParams,
        num_prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        created = int(time.time())
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created}
        head["model"] = self.model_name

        def chunk(index: int, delta: dict, logprobs=None, finish_reason=None) -> dict[str, Any]:
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
            choice["finish_reason"] = finish_reason
            return {**head, "choices": [choice]}

        for i in range(params.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        choices = [Choice() for _ in range(params.n)]
        async for _, out in merge(streams):
            c = choices[out.index]
            c.num_tokens += len(out.new_token_ids)
            fr = finish_reason_of(out)
            if not out.text_delta and fr is None and not out.logprobs:
                continue  # the detokenizer held the text back (stop-string or UTF-8 boundary)
            lp = (
                P.chat_logprobs(out.logprobs, self.token_str)
                if params.logprobs is not None
                else None
            )
            delta = {"content": out.text_delta} if out.text_delta or fr is None else {}
            yield chunk(out.index, delta, lp, fr)
        if include_usage:
            yield {**head, "choices": [], "usage": usage(num_prompt_tokens, choices).model_dump()}

    # -- completions ---------------------------------------------------------------------------

    async def completion(self, req: P.CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix: not supported", "suffix")
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
        prompts = self.completion_prompts(req.prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        self._log_request(request_id, req)
        streams = self.add_all(request_id, prompts, params)
        num_prompt_tokens = sum(len(p) for p in prompts)
        echo_texts = [self.tokenizer.decode(p) if req.echo else "" for p in prompts]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = self._completion_stream(
                request_id, streams, params, prompts, echo_texts, req.echo, include_usage
            )
            return sse(gen, self.shutdown_grace_period)
        choices = await until_disconnect(raw, collect(streams, params.n), streams)
        result_choices = []
        for i, c in enumerate(choices):
            prompt_idx = i // params.n
            logprobs = None
            if params.logprobs is not None:
                echo_ids = prompts[prompt_idx] if req.echo else None
                logprobs = P.completion_logprobs(c.logprobs, self.token_str, 0, echo_ids)
            result_choices.append(
                P.CompletionChoice(
                    index=i,
                    text=echo_texts[prompt_idx] + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        result = P.CompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=result_choices,
            usage=usage(num_prompt_tokens, choices),
        )
        return JSONResponse(P.dump(result))

    async def _completion_stream(
        self,
        request_id: str,
        streams: list[RequestStream],
        params: SamplingParams,
        prompts: list[list[int]],
        echo_texts: list[str],
        echo: bool,
        include_usage: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        head = {"id": request_id, "object": "text_completion", "created": int(time.time())}
        head["model"] = self.model_name
        n = params.n
        choices = [Choice() for _ in range(n * len(prompts))]
        offsets = [0] * len(choices)
        echoed = [not echo] * len(choices)
        async for prompt_idx, out in merge(streams):
            index = prompt_idx * n + out.index
            c = choices[index]
            c.num_tokens += len(out.new_token_ids)
            fr = finish_reason_of(out)
            text = out.text_delta
            echo_ids = None
            if not echoed[index]:
                echoed[index] = True
                text = echo_texts[prompt_idx] + text
                echo_ids = prompts[prompt_idx]
            if not text and fr is None and not out.logprobs:
                continue
            logprobs = None
            if params.logprobs is not None:
                logprobs = P.completion_logprobs(
                    out.logprobs, self.token_str, offsets[index], echo_ids
                )
            offsets[index] += len(text)
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": fr}
            yield {**head, "choices": [choice]}
        if include_usage:
            num_prompt_tokens = sum(len(p) for p in prompts)
            yield {**head, "choices": [], "usage": usage(num_prompt_tokens, choices).model_dump()}

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
            count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids
        )

    def detokenize(self, req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.engine.engine.vocab_size
        for t in req.tokens:
            if not 0 <= t < vocab:
                raise bad_request(f"tokens: token id {t} is outside [0, {vocab})", "tokens")
        return P.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
