"""/v1/chat/completions: messages -> chat template -> prompt ids; tools (tool_formats.py:
the template's own call format or tools.py's JSON envelope, grammar-enforced); responses and SSE
chunks, in which content and tool-call deltas stream as generated (tool_stream.py).
``ChatServing.create`` is the walk; the shared steps it calls are serving.py's."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tinyserve.engine.client import OutputStream
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints import protocol_logprobs as L
from tinyserve.entrypoints import reasoning as R
from tinyserve.entrypoints.protocol import OpenAIError, bad_request
from tinyserve.entrypoints.serving import (
    Job,
    OpenAIServing,
    ToolStream,
    answers_json,
    response_format,
)
from tinyserve.entrypoints.streaming import (
    AnswerResponse,
    Choice,
    input_size,
    off_loop,
    tokens_to_stop,
    usage_info,
)
from tinyserve.entrypoints.tool_stream import feed_step, visible_stop
from tinyserve.outputs import StepOutput, Usage


@dataclass
class ChatJob(Job):
    parsers: dict[int, ToolStream] = field(default_factory=dict)  # streamed
    thinks: bool = False  # the <think> block goes to reasoning_content (reasoning.py)
    thinking_open: bool = False  # the prompt ends inside <think>
    splitters: dict[int, R.ReasoningSplitter] = field(default_factory=dict)  # streamed

    def answered(self) -> bool:
        return len(self.parsers) == self.params.n and all(
            visible_stop(p) is not None for p in self.parsers.values()
        )


class ChatServing(OpenAIServing):
    async def create(self, req: P.ChatCompletionRequest, raw: Request) -> Response:
        """validate -> params -> prompt (``prepare``) -> submit -> stream or collect."""
        try:
            self.check_request(req)
            job = await self.prepare(req)
            stream = await self.submit(job, req)
        except OpenAIError as e:  # named as this request sent them
            sent = "max_completion_tokens" if req.max_completion_tokens is not None else None
            raise P.in_own_words(e, sent, "messages") from None
        if job.stream:
            return self.sse(self.chunks(job, stream))
        return AnswerResponse(self.response(job, *await self.collect(raw, stream, job)))

    async def prepare(self, req: P.ChatCompletionRequest) -> ChatJob:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs=true", "top_logprobs")
        if req.stream and req.prompt_logprobs is not None:  # a chunk has no place for them
            raise bad_request("prompt_logprobs: not available with stream=true on chat "
                              "completions (as vLLM; /v1/completions streams them)",
                              "prompt_logprobs")  # fmt: skip
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise bad_request(f"top_logprobs: must be in [0, 20], got {req.top_logprobs}")
        tools = self.checked_tools(req.tools, req.tool_choice)
        fmt = response_format(req)
        so = self.constraint(req, fmt, "response_format", tools,
                             req.tool_choice, req.parallel_tool_calls)  # fmt: skip
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        params = self.sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            structured_outputs=so,
            **self.tool_decoding(tools),
        )
        prompt_ids = await off_loop(
            input_size([req.messages, tools]), self.chat_prompt_ids, req.messages,
            req.add_generation_prompt, tools, req.tool_choice, req.chat_template_kwargs,
        )  # fmt: skip
        opened = None
        if self.thinks(req.chat_template_kwargs):
            opened = R.split_or_gate(self.tokenizer, prompt_ids, params)
        thinks = opened is not None
        return ChatJob(
            f"chatcmpl-{uuid.uuid4().hex}", [prompt_ids], params, stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
            tools=tools, thinks=thinks, thinking_open=bool(opened),
            json_answer=answers_json(tools, fmt, req.tool_choice),
            format_check=fmt if tools else None,
        )  # fmt: skip

    def response(self, job: Job, choices: list[Choice], usage: Usage | None) -> dict[str, Any]:
        result_choices = []
        for i, c in enumerate(choices):
            finish = c.finish_reason
            reasoning, text = None, c.text
            if job.thinks:
                reasoning, text = R.split_reasoning(c.text, job.thinking_open)
            content, calls, finish, stop = self.answer_tools(
                job, text or "", finish, c.stop_reason, c.unarmed(text or "")
            )
            logprobs = None
            if job.params.logprobs is not None:
                logprobs = L.chat_logprobs(c.logprobs, self.token_str, self.token_bytes)
            message = P.ChatResponseMessage(
                content=content, reasoning_content=reasoning, tool_calls=calls or None
            )
            result_choices.append(
                P.ChatCompletionChoice(
                    index=i,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=stop,
                )  # fmt: skip
            )
        result = P.ChatCompletionResponse(
            id=job.request_id, model=self.model_name, choices=result_choices,
            usage=usage_info(usage),
            prompt_logprobs=L.prompt_logprobs(choices[0].prompt_logprobs, self.token_str),
        )  # fmt: skip
        return P.dump(result)

    def chunks(self, job: ChatJob, stream: OutputStream) -> AsyncIterator[dict[str, Any]]:
        """``data:`` chunks: each choice's role first, then its deltas (in a ChunkFrame: the
        head, the usage)."""
        frame = self.chunk_frame(job, "chat.completion.chunk")
        roles = [_chunk(frame.head, i, {"role": "assistant", "content": ""})
                 for i in range(job.params.n)]  # fmt: skip
        return frame.chunks(stream, partial(self.stream_chunks, job, frame.head), roles)

    def stream_chunks(
        self, job: ChatJob, head: dict[str, Any], out: StepOutput, finish: str | None
    ) -> list[dict[str, Any]]:
        lp = None
        if job.params.logprobs is not None:
            lp = L.chat_logprobs(out.logprobs, self.token_str, self.token_bytes)
        if job.thinks:
            return self._thinking_chunks(job, head, out, finish, lp)
        return self._answer_chunks(job, head, out, out.text_delta, finish, lp)

    def _thinking_chunks(self, job: ChatJob, head, out: StepOutput, finish, lp) -> list[dict]:
        """The reasoning delta as its own chunk, then the content's chunks as without it."""
        splitter = job.splitters.get(out.index)
        if splitter is None:
            splitter = job.splitters[out.index] = R.ReasoningSplitter(job.thinking_open)
        reasoning, content = splitter.step(out.text_delta, finish is not None)
        chunks = (
            [_chunk(head, out.index, {"reasoning_content": reasoning}, lp)] if reasoning else []
        )
        rest = self._answer_chunks(job, head, out, content, finish, None if chunks else lp)
        return chunks + rest

    def _answer_chunks(self, job: ChatJob, head, out: StepOutput, text: str, finish, lp):
        if job.tools:
            parser = job.parsers.get(out.index)
            if parser is None:
                parser = job.parsers[out.index] = self.tool_stream(job)
            events, used = feed_step(parser, out, text)
            events += parser.finish(finish) if finish is not None else []
            if used is not None:  # its text's stop: the tokens (and logprobs) up to it
                job.stop_counts[out.index] = tokens_to_stop(out, used)
                if lp is not None:
                    lp = L.chat_logprobs(out.logprobs[:used], self.token_str, self.token_bytes)
            if not events and out.logprobs and lp is not None and visible_stop(parser) is None:
                events = [({}, None)]
            stop = visible_stop(parser) or out.stop_reason
            return [
                _chunk(head, out.index, delta, lp if n == 0 else None, fr, stop)
                for n, (delta, fr) in enumerate(events)
            ]
        if not text and finish is None and (not out.logprobs or lp is None):
            return []  # held back (a stop string, a UTF-8 boundary, a tag) or all reasoning
        delta = {"content": text} if text or finish is None else {}
        return [_chunk(head, out.index, delta, lp, finish, out.stop_reason)]


def _chunk(head: dict, index: int, delta: dict, logprobs=None, finish_reason=None,
           stop_reason=None) -> dict:  # fmt: skip
    """One choice's chunk; vLLM's ``stop_reason`` (the stop string or token id that ended
    it, as the unstreamed choice has it) on the finishing one."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": stop_reason if finish_reason is not None else None}  # fmt: skip
    return {**head, "choices": [choice]}
