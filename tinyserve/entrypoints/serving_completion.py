"""/v1/completions: prompts as text, token ids or lists of either (one engine request for all
of them; the engine numbers the choices prompt_index * n + sample_index, as OpenAI);
``echo`` puts each prompt's text before its choices. ``CompletionServing.create`` is the walk;
the shared steps it calls are serving.py's."""

from __future__ import annotations

import dataclasses
import functools
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
from tinyserve.entrypoints.protocol import bad_request
from tinyserve.entrypoints.serving import Job, OpenAIServing, response_format
from tinyserve.entrypoints.streaming import (
    AnswerResponse,
    Choice,
    input_size,
    off_loop,
    usage_info,
)
from tinyserve.outputs import StepOutput, TokenLogprob, Usage


@dataclass
class CompletionJob(Job):
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's field, as the request named it
    input_size: int = 0
    echo_texts: list[str] = field(default_factory=list)  # per prompt ("" without echo)
    offsets: dict[int, L.TextOffsets] = field(default_factory=dict)  # streamed, per choice


class CompletionServing(OpenAIServing):
    async def create(self, req: P.CompletionRequest, raw: Request) -> Response:
        """validate -> params -> prompts (``prepare``) -> submit -> the echoed texts -> stream
        or collect."""
        self.check_request(req)
        job = await self.prepare(req)
        stream = await self.submit(job, req)
        try:  # decoded once the engine has checked the token ids
            job.echo_texts = await off_loop(job.input_size, self._echo_texts, job.prompts,
                                            job.echo)  # fmt: skip
        except BaseException:
            stream.abort()
            raise
        if job.stream:
            return self.sse(self.chunks(job, stream))
        return AnswerResponse(self.response(job, *await self.collect(raw, stream, job)))

    async def prepare(self, req: P.CompletionRequest) -> CompletionJob:
        if req.suffix:
            raise bad_request("suffix: not supported", "suffix")
        so = self.constraint(req, response_format(req), "response_format", [])
        prompt_lps = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # the echoed tokens' logprobs: computed
            prompt_lps = max(prompt_lps or 0, req.logprobs)
        params = self.sampling_params(
            req, scores=req.echo, max_tokens=req.max_tokens, logprobs=req.logprobs,
            prompt_logprobs=prompt_lps, structured_outputs=so,
        )  # fmt: skip
        size = input_size(req.prompt) if isinstance(req.prompt, str | list) else 0
        prompts = await off_loop(size, self.completion_prompts, req.prompt)
        return CompletionJob(
            f"cmpl-{uuid.uuid4().hex}", prompts, params, stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
            echo=req.echo, prompt_logprobs=req.prompt_logprobs, input_size=size,
        )  # fmt: skip

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

    def _echo_texts(self, prompts: list[list[int]], echo: bool) -> list[str]:
        return [self.tokenizer.decode(p) if echo else "" for p in prompts]

    def response(
        self, job: CompletionJob, choices: list[Choice], usage: Usage | None
    ) -> dict[str, Any]:
        result_choices = []
        for i, c in enumerate(choices):
            logprobs = self._logprobs(job, c.prompt_index, c.logprobs, c.prompt_logprobs,
                                      L.TextOffsets())  # fmt: skip
            result_choices.append(
                P.CompletionChoice(
                    index=i,
                    text=job.echo_texts[c.prompt_index] + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=self._vllm_prompt_logprobs(job, c.prompt_logprobs),
                )  # fmt: skip
            )
        result = P.CompletionResponse(
            id=job.request_id, model=self.model_name, choices=result_choices,
            usage=usage_info(usage),
        )  # fmt: skip
        return P.dump(result)

    def chunks(self, job: CompletionJob, stream: OutputStream) -> AsyncIterator[dict[str, Any]]:
        """``data:`` chunks, each choice's first with its echo (in a ChunkFrame: the head, the
        usage)."""
        frame = self.chunk_frame(job, "text_completion")
        return frame.chunks(stream, partial(self.stream_chunks, job, frame.head))

    def stream_chunks(
        self, job: CompletionJob, head: dict[str, Any], out: StepOutput, finish: str | None
    ) -> list[dict[str, Any]]:
        text, first = out.text_delta, out.index not in job.offsets
        if job.echo and first:  # a choice's first chunk carries the echo
            text = job.echo_texts[out.prompt_index] + text
        if not text and finish is None and not out.logprobs and not first:
            return []
        # The tokens' own text, as unstreamed: not the text sent, which a stop string or a
        # part character holds back.
        offsets = job.offsets.setdefault(out.index, L.TextOffsets())
        prompt_lps = out.prompt_logprobs if first else None
        logprobs = self._logprobs(job, out.prompt_index, out.logprobs, prompt_lps, offsets,
                                  echoed=first)  # fmt: skip
        choice = {"index": out.index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": out.stop_reason if finish is not None else None}  # fmt: skip
        if first and job.params.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(job, prompt_lps)
        return [{**head, "choices": [choice]}]

    def _logprobs(self, job: CompletionJob, prompt_index: int, lps, prompt_lps,
                  offsets: L.TextOffsets, echoed: bool = True) -> dict | None:  # fmt: skip
        """The legacy ``logprobs`` object: the echoed prompt's tokens (with the first output)
        and then the generated ones."""
        if job.params.logprobs is None:
            return None
        echo_ids = job.prompts[prompt_index] if job.echo and echoed else None
        prompt_lps = _top(prompt_lps, job.params.logprobs) if echo_ids else None
        skipped = self._special_ids if job.params.skip_special_tokens else frozenset()
        return L.completion_logprobs(lps, self.token_str, self.token_bytes, offsets, echo_ids,
                                     prompt_lps, job.echo_texts[prompt_index], skipped)  # fmt: skip

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        """What a decode with skip_special_tokens leaves out: every added token marked special
        (SmolLM2's 17, not only the 3 of ``all_special_ids``)."""
        if self.tokenizer is None:  # (ids' names stand for tokens: nothing is skipped)
            return frozenset()
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        return frozenset(self.tokenizer.all_special_ids) | frozenset(
            i for i, t in added.items() if getattr(t, "special", False))  # fmt: skip

    def _vllm_prompt_logprobs(self, job: CompletionJob, lps) -> P.PromptLogprobs | None:
        """vLLM's field, only when the request asked for it by name (``echo`` alone fills the
        legacy object)."""
        if job.prompt_logprobs is None:
            return None
        return L.prompt_logprobs(_top(lps, job.prompt_logprobs), self.token_str)


def _top(lps: list[TokenLogprob | None] | None, k: int) -> list[TokenLogprob | None] | None:
    """Prompt logprobs with at most ``k`` alternatives each (the engine computed the most
    that the request's two fields asked for)."""
    if lps is None:
        return None
    return [lp if lp is None or len(lp.top) <= k else dataclasses.replace(lp, top=lp.top[:k])
            for lp in lps]  # fmt: skip
