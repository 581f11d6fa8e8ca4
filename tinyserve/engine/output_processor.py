"""OutputProcessor: per-request output state, from the engine's Requests to StepOutputs. No torch.

It owns everything a client sees of a request beyond its token ids:

* the fan-out: one engine request is one or more prompts times ``n`` samples; each is a
  child ``Request`` with its choice index (``prompt_index * n + sample``, OpenAI's order),
  grouped under one ``ParentRequest`` that knows when the last child has finished;
* the incremental detokenizer and stop strings of each child (the scheduler decides EOS,
  stop token ids and length; a stop string is found here and handed back to the caller,
  who has the scheduler finish the request: ``Request.status`` has one owner);
* usage: prompt tokens (each prompt once, whatever ``n``), completion tokens, cached tokens.

The server, the streaming layer and the offline ``LLM`` read ``StepOutput.index``,
``prompt_index``, ``request_finished`` and ``usage`` and compute no indices of their own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field

from tinyserve.engine.detokenizer import IncrementalDetokenizer
from tinyserve.outputs import ModelRunnerOutput, StepOutput, Usage, count_cached
from tinyserve.request import Request, RequestStatus
from tinyserve.sampling_params import SamplingParams
from tinyserve.structured.schema_approx import final_check, needs_final_check

logger = logging.getLogger(__name__)


def as_prompts(prompt: list[int] | list[list[int]]) -> list[list[int]]:
    """One prompt (token ids) or several (a list of token-id lists) -> a list of prompts."""
    if prompt and all(isinstance(p, list | tuple) for p in prompt):
        return [list(p) for p in prompt]  # type: ignore[arg-type]
    return [list(prompt)]  # type: ignore[arg-type]


def child_seed(seed: int | None, sample: int) -> int | None:
    """Sample ``sample`` of an n>1 request draws from seed + sample, wrapped into int64 (a seed
    near 2**63 - 1 is valid input; its children's seeds must be too)."""
    if seed is None:
        return None
    return (seed + sample + 2**63) % 2**64 - 2**63


def child_ids(request_id: str, num_children: int) -> list[str]:
    """The engine ids of a request's children: the request's own id when it has one child."""
    if num_children == 1:
        return [request_id]
    return [f"{request_id}#{k}" for k in range(num_children)]


@dataclass
class ParentRequest:
    """One engine request: its children (choice order) and its running usage."""

    request_id: str
    n: int
    live: set[str]
    usage: Usage
    detokenizers: dict[str, IncrementalDetokenizer] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)  # outputs.count_cached's

    @property
    def finished(self) -> bool:
        return not self.live


@dataclass
class ProcessedOutputs:
    outputs: list[StepOutput]
    # Children whose stop string was found this step while still running: the caller has the
    # scheduler finish them (FINISHED_STOPPED), which frees their blocks.
    stop_string_ids: list[str]
    # Children whose output raised while still running: the caller finishes them as errors.
    failed_ids: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, ParentRequest] = {}  # child id -> parent

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def add_request(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        arrival_time: float,
    ) -> list[Request]:
        """Build every child of a request (all or nothing: a bad one raises ValueError before
        any state is kept) and register the parent. Returns the children to schedule."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        ids = child_ids(request_id, len(prompts) * params.n)
        if taken := [rid for rid in ids if rid in self._parent_of]:
            raise ValueError(f"request id {taken[0]!r} is already in the engine")
        usage = Usage(prompt_tokens=sum(len(p) for p in prompts))
        parent = ParentRequest(request_id, params.n, set(ids), usage)
        children = []
        for k, rid in enumerate(ids):
            prompt, sample = prompts[k // params.n], k % params.n
            child_params = params
            if params.n > 1:
                child_params = dataclasses.replace(
                    params, n=1, seed=child_seed(params.seed, sample)
                )
            req = Request(
                request_id=rid,
                prompt_token_ids=list(prompt),
                sampling_params=child_params,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
                arrival_time=arrival_time,
                parent_id=request_id,
                index=k,
            )
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, child_params)
                parent.detokenizers[rid] = detok
            children.append(req)
        self.parents[request_id] = parent
        self._parent_of.update(dict.fromkeys(ids, parent))
        return children

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the ids of its children still live in the engine."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        for rid in parent.live:
            del self._parent_of[rid]
        return sorted(parent.live)

    def process(self, requests: list[Request], runner_out: ModelRunnerOutput) -> ProcessedOutputs:
        """One StepOutput for each request that got a token or finished this step."""
        result = ProcessedOutputs([], [])
        for req in requests:
            parent = self._parent_of.get(req.request_id)
            if parent is None:  # aborted meanwhile
                continue
            try:
                if req.status == RequestStatus.FINISHED_ERROR:
                    out = self._error_output(parent, req)
                else:
                    out = self._token_output(parent, req, runner_out, result.stop_string_ids)
                    if out.finish_reason == "stop" and out.stop_reason is None:
                        out = self._final_check(req, out)
            except Exception as e:  # noqa: BLE001 - one request's output fails it, not the engine
                logger.exception("output of %s failed", req.request_id)
                req.error = f"internal error: {type(e).__name__}: {e}"
                out = self._error_output(parent, req)
                if not req.is_finished:
                    result.failed_ids.append(req.request_id)
            if out.finish_reason is not None:
                self._finish_child(parent, req.request_id, out)
            result.outputs.append(out)
        return result

    def _token_output(
        self, parent: ParentRequest, req: Request, runner_out: ModelRunnerOutput, stops: list[str]
    ) -> StepOutput:
        rid = req.request_id
        new_ids = list(runner_out.sampled_token_ids.get(rid, ()))
        finish_reason = req.status.finish_reason if req.is_finished else None
        stop_reason = req.stop_reason
        text_delta, armed_from, token_ends = "", 0, None
        num_output = req.num_output_tokens
        detok = parent.detokenizers.get(rid)
        if detok is not None:
            # A stop token (stop_token_ids, or EOS: its "<|im_end|>" showed with
            # skip_special_tokens false) ends the text before it unless
            # include_stop_str_in_output, as a stop string does (vLLM's detokenizer too); its
            # id stays in the output's tokens.
            shown = new_ids
            if (new_ids and _stopped_by_token(req, new_ids[-1])
                    and not req.sampling_params.include_stop_str_in_output):  # fmt: skip
                shown = new_ids[:-1]
            first = req.sampling_params.min_tokens - (num_output - len(new_ids))
            text_delta, stop_str, used, ends, armed_from = _detokenize_armed(
                detok, shown, req.is_finished, first
            )
            token_ends = ends if len(new_ids) > 1 else None
            if stop_str is not None:
                if not req.is_finished:
                    stops.append(rid)
                finish_reason, stop_reason = "stop", stop_str
                # A stop string inside a speculative run: the tokens after it never happened.
                num_output -= len(new_ids) - used
                new_ids = new_ids[:used]
        lps = runner_out.logprobs.get(rid, [])[: len(new_ids)]
        prompt_lps = None  # with the choice's first output (before it, no output token)
        if req.sampling_params.prompt_logprobs is not None and num_output == len(new_ids):
            prompt_lps = [None, *req.prompt_logprobs]
        parent.usage.completion_tokens += len(new_ids)
        parent.usage.cached_tokens = count_cached(parent.cached, req.index // parent.n,
                                                  req.num_cached_tokens)  # fmt: skip
        prediction = req.sampling_params.prediction
        if prediction is not None and finish_reason is not None:
            parent.usage.count_prediction(prediction, req.output_token_ids[:num_output])
        return StepOutput(
            request_id=parent.request_id,
            index=req.index,
            prompt_index=req.index // parent.n,
            new_token_ids=new_ids,
            text_delta=text_delta,
            finish_reason=finish_reason,
            logprobs=lps,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=num_output,
            num_cached_tokens=req.num_cached_tokens,
            stop_reason=stop_reason,
            armed_from=armed_from,
            token_ends=token_ends,
            prompt_logprobs=prompt_lps,
        )

    def _final_check(self, req: Request, out: StepOutput) -> StepOutput:
        """A JSON answer its grammar ended, whose schema has keywords the grammar only narrows
        or drops (structured/schema_approx.py), validated against the schema as written; an
        invalid one becomes the request's error (a 400 naming the field), never a 200."""
        so = req.sampling_params.structured_outputs
        if so is None or (so.json is None and so.answer_check is None) or self.tokenizer is None:
            return out
        schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
        if so.answer_check is None and not needs_final_check(schema):
            return out
        ids = req.output_token_ids
        if so.think_end_id is not None and so.think_end_id in ids:
            ids = ids[len(ids) - ids[::-1].index(so.think_end_id) :]  # the answer after </think>
        text = self.tokenizer.decode(
            ids, skip_special_tokens=req.sampling_params.skip_special_tokens
        )
        try:
            why = so.answer_check(text) if so.answer_check else final_check(schema, text)
        except Exception as e:  # noqa: BLE001 - the validator's own limits end the request
            # (jsonschema's multipleOf over a 330-digit number: OverflowError), not the engine
            why = f"the answer could not be checked against the schema ({type(e).__name__}: {e})"
        if why is None:
            return out
        return dataclasses.replace(out, finish_reason="error", error=f"{so.field}: {why}",
                                   error_param=so.field)  # fmt: skip

    @staticmethod
    def _error_output(parent: ParentRequest, req: Request) -> StepOutput:
        return StepOutput(
            request_id=parent.request_id,
            index=req.index,
            prompt_index=req.index // parent.n,
            new_token_ids=[],
            text_delta="",
            finish_reason="error",
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            error=req.error or "internal error",
            error_param=req.error_param,
        )

    def _finish_child(self, parent: ParentRequest, rid: str, out: StepOutput) -> None:
        """Drop a finished child's state; the parent goes with its last child, whose output
        carries the request's usage and ``request_finished``."""
        parent.live.discard(rid)
        parent.detokenizers.pop(rid, None)
        self._parent_of.pop(rid, None)
        if parent.finished:
            del self.parents[parent.request_id]
            out.request_finished = True
            out.usage = parent.usage


def _stopped_by_token(req: Request, token_id: int) -> bool:
    """The request ended on ``token_id``: a stop id, or EOS (check_stop's, or a grammar's end,
    ignore_eos or not)."""
    if req.status != RequestStatus.FINISHED_STOPPED:
        return False
    return token_id == req.stop_reason if isinstance(req.stop_reason, int) else (
        token_id in req.eos_token_ids)  # fmt: skip


def _detokenize_armed(detok, token_ids: list[int], finished: bool, first: int):
    """_detokenize, and where in the delta stop strings begin to count (StepOutput.armed_from)
    where ``first`` is the index of the step's first output token past min_tokens: a step of
    several tokens (speculative decoding) may cross it, and is decoded in two parts there (the
    first cannot meet a stop string: the detokenizer's own count too)."""
    if first <= 0:
        return *_detokenize(detok, token_ids, finished), 0
    if first >= len(token_ids):
        return *_detokenize(detok, token_ids, finished), None
    head, _, _, ends = _detokenize(detok, token_ids[:first], False)
    tail, stop, used, tail_ends = _detokenize(detok, token_ids[first:], finished)
    return head + tail, stop, first + used, ends + [len(head) + e for e in tail_ends], len(head)


def _detokenize(detok, token_ids: list[int], finished: bool):
    """Feed a step's tokens one at a time (several with speculative decoding), so a stop
    string ends the output at the token that completes it, as in plain decoding. Returns
    (text delta, the stop string or None, how many tokens were used, where in the delta
    each used token's text ends: StepOutput.token_ends)."""
    if len(token_ids) <= 1:
        delta, stop_str = detok.update(token_ids, finished=finished)
        return delta, stop_str, len(token_ids), [len(delta)] * len(token_ids)
    parts, ends = [], []
    for i, token_id in enumerate(token_ids):
        delta, stop_str = detok.update([token_id], finished=finished and i == len(token_ids) - 1)
        parts.append(delta)
        ends.append((ends[-1] if ends else 0) + len(delta))
        if stop_str is not None:
            return "".join(parts), stop_str, i + 1, ends
    return "".join(parts), None, len(token_ids), ends
