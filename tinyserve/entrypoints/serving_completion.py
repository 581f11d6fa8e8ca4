"""/v1/completions: prompts as text, token ids or lists of either (one engine request for all
of them; the engine numbers the choices prompt_index * n + sample_index, as OpenAI);
``echo`` puts each prompt's text before its choices. The shared steps are serving.py's."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tinyserve.engine.client import OutputStream
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints.protocol import bad_request
from tinyserve.entrypoints.serving import Job, OpenAIServing, response_format
from tinyserve.entrypoints.streaming import Choice, input_size, off_loop, usage_info
from tinyserve.outputs import StepOutput, Usage


@dataclass
class CompletionJob(Job):
    echo: bool = False
    input_size: int = 0
    echo_texts: list[str] = field(default_factory=list)  # per prompt ("" without echo)
    offsets: dict[int, int] = field(default_factory=dict)  # streamed: choice -> characters sent


class CompletionServing(OpenAIServing):
    chunk_object = "text_completion"

    async def prepare(self, req: P.CompletionRequest, raw: Request) -> CompletionJob:
        if req.suffix:
            raise bad_request("suffix: not supported", "suffix")
        so = self.constraint(req, response_format(req), "response_format", [])
        params = self.sampling_params(
            req, max_tokens=req.max_tokens, logprobs=req.logprobs, structured_outputs=so
        )
        size = input_size(req.prompt) if isinstance(req.prompt, str | list) else 0
        prompts = await off_loop(size, self.completion_prompts, req.prompt)
        return CompletionJob(
            f"cmpl-{uuid.uuid4().hex}", prompts, params, stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            echo=req.echo, input_size=size,
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

    async def submitted(self, job: CompletionJob, stream: OutputStream) -> None:
        """The echoed texts, decoded once the engine has checked the token ids."""
        job.echo_texts = await off_loop(job.input_size, self._echo_texts, job.prompts, job.echo)

    def _echo_texts(self, prompts: list[list[int]], echo: bool) -> list[str]:
        return [self.tokenizer.decode(p) if echo else "" for p in prompts]

    def response(
        self, job: CompletionJob, choices: list[Choice], usage: Usage | None
    ) -> dict[str, Any]:
        result_choices = []
        for i, c in enumerate(choices):
            logprobs = None
            if job.params.logprobs is not None:
                echo_ids = job.prompts[c.prompt_index] if job.echo else None
                logprobs = P.completion_logprobs(c.logprobs, self.token_str, 0, echo_ids)
            result_choices.append(
                P.CompletionChoice(
                    index=i, text=job.echo_texts[c.prompt_index] + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                )  # fmt: skip
            )
        result = P.CompletionResponse(
            id=job.request_id, model=self.model_name, choices=result_choices,
            usage=usage_info(usage),
        )  # fmt: skip
        return P.dump(result)

    def stream_chunks(
        self, job: CompletionJob, head: dict[str, Any], out: StepOutput, finish: str | None
    ) -> list[dict[str, Any]]:
        text, echo_ids = out.text_delta, None
        if job.echo and out.index not in job.offsets:  # a choice's first chunk carries the echo
            text = job.echo_texts[out.prompt_index] + text
            echo_ids = job.prompts[out.prompt_index]
        if not text and finish is None and not out.logprobs:
            return []
        offset = job.offsets.get(out.index, 0)
        logprobs = None
        if job.params.logprobs is not None:
            logprobs = P.completion_logprobs(out.logprobs, self.token_str, offset, echo_ids)
        job.offsets[out.index] = offset + len(text)
        choice = {"index": out.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return [{**head, "choices": [choice]}]
