"""A stand-in for LLMEngine implementing the same ``SyncEngine`` protocol (engine/client.py),
no model: fast tests of the async engine and of failure paths (429, a dead engine thread, one
request failing) that a real model cannot be made to produce on demand."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tinyserve.engine.client import EngineInfo, EngineStats
from tinyserve.engine.engine_view import empty_snapshot
from tinyserve.engine.output_processor import as_prompts, child_ids
from tinyserve.outputs import StepOutput, Usage
from tinyserve.sampling_params import SamplingParams

FAIL_TOKEN = 13  # a prompt holding this token id fails with finish_reason "error"


@dataclass
class _Seq:
    parent: str
    index: int
    num_prompt_tokens: int
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    fail: bool = False
    stop: list[str] = field(default_factory=list)  # stop strings, matched on the raw text
    min_tokens: int = 0  # stop strings count past this many output tokens
    text: str = ""


class FakeEngine:
    """Emits token ``100 + k`` with text ``"t{k} "`` for the k-th output token of a request
    (with a ``script``: the text ``script[k]``, finishing with "stop" after the last piece);
    a stop string ends the text before it as the engine's detokenizer does (no hold-back).

    ``step_delay`` seconds per step; ``explode = True`` makes the next ``step()`` raise
    (kills the engine thread). Counts calls so tests can see the thread sleeping when idle.
    """

    def __init__(
        self,
        tokenizer=None,
        max_num_seqs: int = 4,
        step_delay: float = 0.0,
        vocab_size: int = 49152,
        max_model_len: int = 512,
        script: list[str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.info = EngineInfo("fake-model", "/fake", vocab_size, max_model_len, 1024, max_num_seqs)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.usage: dict[str, Usage] = {}  # parent id -> usage so far
        self.step_delay = step_delay
        self.explode = False
        self.seqs: dict[str, _Seq] = {}
        self.aborted: list[str] = []
        self.num_steps = 0
        self.num_has_unfinished_calls = 0
        self.step_records: list[dict] | None = None  # the live view: None while unwatched
        self.num_snapshot_calls = 0

    def validate_request(self, prompts, params: SamplingParams) -> None:
        for prompt in as_prompts(prompts):
            self._validate_prompt(prompt, params)

    def _validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        for t in prompt_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt: token id {t!r} is outside [0, {self.vocab_size})")
        params.validate_for_model(self.vocab_size)
        n = len(prompt_token_ids)
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the context window of {self.max_model_len} tokens"
            )

    def add_request(self, request_id, prompts, params, arrival_time=None, validated=False) -> None:
        prompts = as_prompts(prompts)
        if not validated:
            self.validate_request(prompts, params)
        ids = child_ids(request_id, len(prompts) * params.n)
        for k, rid in enumerate(ids):
            prompt = prompts[k // params.n]
            n, fail = len(prompt), FAIL_TOKEN in prompt
            max_tokens = params.max_tokens or self.max_model_len - n
            self.seqs[rid] = _Seq(request_id, k, n, max_tokens, fail=fail, stop=list(params.stop),
                                  min_tokens=params.min_tokens)  # fmt: skip
        self.usage[request_id] = Usage(prompt_tokens=sum(len(p) for p in prompts))

    def abort(self, request_id: str) -> bool:
        ids = [rid for rid, s in self.seqs.items() if s.parent == request_id]
        for rid in ids:
            del self.seqs[rid]
        self.usage.pop(request_id, None)
        self.aborted.append(request_id)
        return bool(ids)

    def health_problem(self) -> str | None:
        return None

    def compile_grammar(self, params: SamplingParams):
        return None

    def warm_up(self) -> None:
        pass

    def close(self) -> None:
        pass

    def has_unfinished(self) -> bool:
        self.num_has_unfinished_calls += 1
        return bool(self.seqs)

    @property
    def running(self) -> list[str]:
        return list(self.seqs)[: self.max_num_seqs]

    def step(self) -> list[StepOutput]:
        self.num_steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.explode:
            raise RuntimeError("the fake engine exploded")
        if self.step_records is not None:
            self.step_records.append(self._step_record())
        outputs = []
        for rid in self.running:
            s = self.seqs[rid]
            if s.fail:
                del self.seqs[rid]
                out = StepOutput(s.parent, [], "", "error", s.index, error="fake failure")
                outputs.append(self._finish_parent(out))
                continue
            k = len(s.tokens)
            s.tokens.append(100 + k)
            self.usage[s.parent].completion_tokens += 1
            done = len(s.tokens) >= s.max_tokens
            ended = self.script is not None and len(s.tokens) >= len(self.script)
            piece = self.script[k] if self.script is not None else f"t{k} "
            armed = len(s.tokens) > s.min_tokens
            stops = s.stop if armed else []
            hits = sorted((i, stop) for stop in stops if (i := (s.text + piece).find(stop)) >= 0)
            if hits:
                piece, ended = (s.text + piece)[len(s.text) : max(hits[0][0], len(s.text))], True
            s.text += piece
            if done or ended:
                del self.seqs[rid]
            out = StepOutput(
                s.parent,
                [100 + k],
                piece,
                "stop" if ended else "length" if done else None,
                s.index,
                num_prompt_tokens=s.num_prompt_tokens,
                num_output_tokens=len(s.tokens),
                stop_reason=hits[0][1] if hits else None,
                armed_from=0 if armed else None,
            )
            outputs.append(self._finish_parent(out) if done or ended else out)
        return outputs

    def _finish_parent(self, out: StepOutput) -> StepOutput:
        """Mark the parent's last output as the engine's output processor does."""
        if not any(s.parent == out.request_id for s in self.seqs.values()):
            out.request_finished = True
            out.usage = self.usage.pop(out.request_id)
        return out

    def stats(self) -> EngineStats:
        running = len(self.running)
        return EngineStats(
            num_running=running,
            num_waiting=len(self.seqs) - running,
            kv_cache_usage=running / 64,
            num_free_blocks=64 - running,
            num_total_blocks=64,
            num_preemptions=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            prompt_tokens_total=0,
            generation_tokens_total=0,
            num_steps=self.num_steps,
        )

    # -- the live engine view: every running sequence decodes, one block each ------------------

    def _step_record(self) -> dict:
        running = len(self.running)
        return {"step": self.num_steps, "ms": self.step_delay * 1000.0, "decode": running,
                "prefill": [], "prefill_tokens": 0, "preempted": [], "spec_tokens": 0,
                "running": running, "waiting": len(self.seqs) - running,
                "kv_usage": running / 64}  # fmt: skip

    def watch(self, on: bool) -> None:
        if not on:
            self.step_records = None
        elif self.step_records is None:
            self.step_records = []

    def snapshot(self, take_steps: bool = True) -> dict:
        self.num_snapshot_calls += 1
        snap = empty_snapshot(self.num_steps, num_blocks=64)
        stats = self.stats()
        snap.update(running=stats.num_running, waiting=stats.num_waiting)
        snap["kv"].update(used=stats.num_total_blocks - stats.num_free_blocks,
                          free=stats.num_free_blocks, usage=stats.kv_cache_usage)  # fmt: skip
        snap["pool"] = "u" * stats.num_running + "." * stats.num_free_blocks
        if take_steps and self.step_records:
            snap["steps"], self.step_records = self.step_records, []
        return snap
