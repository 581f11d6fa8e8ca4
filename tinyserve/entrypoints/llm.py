"""The offline API, mirroring vLLM: ``LLM(model=...).generate(prompts, params)`` / ``.chat``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.outputs import CompletionOutput, RequestOutput
from tinyserve.sampling_params import SamplingParams

PromptType = str | list[int]


class LLM:
    """``LLM(model, **engine_args)``; or ``LLM(engine=...)`` over an engine already built."""

    def __init__(self, model: str | None = None, engine: LLMEngine | None = None, **kwargs) -> None:
        self.engine = engine if engine is not None else LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run the prompts (strings or token-id lists) to completion, batched by the engine.
        Results come back in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params: got {len(params)} for {len(prompts)} prompts; pass one or one each"
            )
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompts, params, strict=True):
            rid = f"llm-{next(self._ids)}"
            try:
                token_ids = self._encode(prompt)
                self.engine.add_request(rid, token_ids, p)
            except Exception:
                for added in order:  # all or nothing: don't leave the earlier prompts queued
                    self.engine.abort(added)
                raise
            order.append(rid)
            results[rid] = RequestOutput(
                request_id=rid,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=token_ids,
                outputs=[
                    CompletionOutput(i, "", [], None, [] if p.logprobs is not None else None)
                    for i in range(p.n)
                ],
                finished=False,
            )
        self._run(results, use_tqdm and len(prompts) > 1)
        return [results[rid] for rid in order]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with the assistant generation prompt) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict]) -> list[int]:
        """The conversation through the chat template as the server renders it
        (chat_template.render_chat: content parts joined, ``developer`` as ``system`` where
        the template has no such role); a bad message is a ValueError naming it."""
        from tinyserve.entrypoints.chat_template import render_chat
        from tinyserve.entrypoints.protocol import OpenAIError

        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        try:
            return render_chat(self.tokenizer, _chat_messages(conversation))
        except OpenAIError as e:  # the template refused the conversation
            raise ValueError(e.message) from None

    def _encode(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        """Step until every request of ``results`` is done. Interrupted (Ctrl+C in a
        notebook) or failing, its requests are aborted, so that the next call starts clean:
        they stayed queued, and the next call met their outputs (KeyError, every call)."""
        try:
            self._steps(results, use_tqdm)
        except BaseException:
            for rid, result in results.items():
                if not result.finished:
                    self.engine.abort(rid)
            raise

    def _steps(self, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(results), desc="generating", unit="prompt")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                result = results.get(out.request_id)
                if result is None:  # not this call's (an engine shared with other callers)
                    continue
                choice = result.outputs[out.index]
                choice.token_ids.extend(out.new_token_ids)
                choice.text += out.text_delta
                if choice.logprobs is not None:
                    choice.logprobs.extend(out.logprobs)
                if out.prompt_logprobs is not None and result.prompt_logprobs is None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    choice.finish_reason = out.finish_reason
                    choice.stop_reason = out.stop_reason
                if out.request_finished:
                    result.finished = True
                    result.num_cached_tokens = out.usage.cached_tokens if out.usage else 0
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()


def _chat_messages(conversation) -> list:
    """OpenAI-style message dicts as the server's ChatMessage models (its checks: a role,
    text content parts, content where the role needs it); a bad one is a ValueError naming
    it (the template failed inside jinja)."""
    from pydantic import ValidationError

    from tinyserve.entrypoints.protocol import ChatMessage
    from tinyserve.entrypoints.protocol_base import error_messages

    if not isinstance(conversation, list):
        raise ValueError("messages: a list of {'role', 'content'} dicts (or a list of such lists)")
    out = []
    for i, m in enumerate(conversation):
        try:
            out.append(ChatMessage.model_validate(m))
        except ValidationError as e:
            where, msg = error_messages(e.errors())[0]
            raise ValueError(f"messages[{i}]{'.' + where if where else ''}: {msg}") from None
    return out
