"""Helpers for the engine acceptance tests (CPU, fp32): building engines, driving them, prompts.

Engines are cheap to build here: the model weights and the tokenizer are loaded once per
process and shared by every engine built with :func:`build_engine` / :func:`build_llm`
(the model is only ever used for inference, so sharing it is safe). Each engine still gets
its own KV cache, scheduler and runner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from tinyserve.engine.arg_utils import EngineArgs
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.request import Request
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker.executor import Executor

TINY_VOCAB = 256

_models: dict[tuple, tuple] = {}
_tokenizers: dict[str, object] = {}


def _shared_model(args: EngineArgs) -> tuple:
    """(model, source) for ``args``, loaded once per process."""
    from tinyserve.models.loader import load_shard
    from tinyserve.worker.device import resolve_device

    # The loaded weights depend on the load config but for how the cache and steps run.
    load = dataclasses.replace(
        args.create_configs().load, kv_cache_dtype="auto", enforce_eager=False
    )
    if load not in _models:
        _models[load] = load_shard(load, getattr(torch, args.dtype), resolve_device(args.device))
    return _models[load]


def _shared_tokenizer(source):
    from tinyserve.models.loader import load_tokenizer

    key = str(source.path)
    if key not in _tokenizers:
        _tokenizers[key] = load_tokenizer(source)
    return _tokenizers[key]


def build_engine(**kwargs) -> LLMEngine:
    """``LLMEngine(EngineArgs(dtype="float32", device="cpu", **kwargs))``, over a real
    Executor whose model weights (and tokenizer) are shared by every engine of the process.
    Speculation off unless asked for: the engine tests' schedules and step counts are those
    of plain decoding (the default, suffix decoding, is tests/spec_decode's and the servers')."""
    args = EngineArgs(**{"dtype": "float32", "device": "cpu", "speculative_config": None, **kwargs})
    if args.tensor_parallel_size > 1:  # a shard belongs to its process group
        return LLMEngine(args)
    executor = Executor(args.create_configs(), loaded=_shared_model(args))
    tokenizer = _shared_tokenizer(executor.source) if args.load_tokenizer else None
    return LLMEngine(args, executor=executor, tokenizer=tokenizer)


def record_schedules(engine: LLMEngine) -> list:
    """Wrap the engine's scheduler so each step's SchedulerOutput is appended to a list."""
    scheduler = engine.core.scheduler
    schedule, seen = scheduler.schedule, []

    def recording_schedule():
        seen.append(schedule())
        return seen[-1]

    scheduler.schedule = recording_schedule
    return seen


def build_llm(**kwargs):
    """``LLM(dtype="float32", **kwargs)`` with shared weights."""
    from tinyserve.entrypoints.llm import LLM

    return LLM(engine=build_engine(**kwargs))


def tiny_engine(path: str, **kwargs) -> LLMEngine:
    kwargs = {"num_blocks": 256, "block_size": 4, "load_tokenizer": False, **kwargs}
    return build_engine(model=path, **kwargs)


def random_prompt(n: int, seed: int, vocab: int = TINY_VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


# ---------------------------------------------------------------- driving the engine


@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


class Collector:
    """Accumulates StepOutputs per (request id, choice index)."""

    def __init__(self) -> None:
        self.choices: dict[str, dict[int, Choice]] = {}

    def feed(self, outputs) -> None:
        for out in outputs:
            c = self.choices.setdefault(out.request_id, {}).setdefault(out.index, Choice())
            assert c.finish_reason is None, f"{out.request_id}: output after it finished"
            c.token_ids.extend(out.new_token_ids)
            if out.text_delta:
                c.deltas.append(out.text_delta)
            c.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                assert c.prompt_logprobs is None, f"{out.request_id}: prompt logprobs twice"
                c.prompt_logprobs = out.prompt_logprobs
            if out.finished:
                c.finish_reason = out.finish_reason
                c.stop_reason = out.stop_reason
                c.num_cached_tokens = out.num_cached_tokens
                c.error = out.error

    def __getitem__(self, request_id: str) -> Choice:
        return self.choices[request_id][0]


def drain(engine: LLMEngine, collector: Collector | None = None, max_steps: int = 5000):
    """Step until the engine has nothing left; returns the collector."""
    collector = collector or Collector()
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return collector
        collector.feed(engine.step())
    raise AssertionError(f"engine did not finish within {max_steps} steps")


def run_batch(engine: LLMEngine, requests) -> Collector:
    """``requests``: (request_id, prompt_token_ids, SamplingParams); all added, then drained."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    return drain(engine)


def run_alone(engine: LLMEngine, requests) -> Collector:
    """Each request on its own, one after the other, on an otherwise idle engine."""
    collector = Collector()
    for rid, prompt, params in requests:
        assert not engine.has_unfinished()
        engine.add_request(rid, prompt, params)
        drain(engine, collector)
    return collector


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **kw}
    )


def kv_request(rid: str, tokens) -> Request:
    """A request for driving a KV-cache manager directly (no engine)."""
    return Request(rid, list(tokens), SamplingParams(max_tokens=32), max_model_len=128)


def kv_step(kv, request: Request, num_new: int, hits=None) -> list[int]:
    """One step of ``request`` through the manager ``kv``: its slots allocated (they must
    fit) and its tokens counted as computed. Returns the (group 0) block table."""
    table = kv.allocate_slots(request, num_new, hits)
    assert table is not None
    request.num_computed_tokens += num_new
    return table


def held_blocks(manager, request_id: str) -> int:
    """The blocks a manager (or one layer group's) holds for a request: its table less the
    entries released left of the window."""
    return len(manager.get_block_ids(request_id)) - manager.num_dead_blocks(request_id)


def held_blocks_each_step(engine: LLMEngine, rid: str) -> list[tuple[int, ...]]:
    """Records the blocks ``rid`` holds in each step, one count per layer group (one group
    but for hybrid models), and, once each step is scheduled (its releases done) and before
    it runs, fills every free block's K/V with random values: a block released while one of
    the step's queries still reads it would change the tokens (prefix caching off: a free
    block is never read again). The groups share one pool, so one free list serves all."""
    kv, sched, seen = engine.core.kv_cache_manager, engine.core.scheduler, []
    schedule, gen = sched.schedule, torch.Generator().manual_seed(0)
    caches = {id(c): c for pair in engine.executor.runner.kv_caches for c in pair}.values()

    def scribbling_schedule():
        out = schedule()
        if rid in kv.req_to_blocks:
            seen.append(tuple(held_blocks(group, rid) for group in kv.groups))
        free = torch.tensor(kv.free_block_ids, dtype=torch.int64)
        for cache in caches:
            cache[free] = torch.randn(cache[free].shape, generator=gen) * 10
        return out

    sched.schedule = scribbling_schedule
    return seen


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after ``prompt`` and each one's logprob (float64)."""
    from tinyserve.testing.checkpoints import hf_logits

    out: list[int] = []
    lps: list[float] = []
    for _ in range(n):
        row = hf_logits(hf, prompt + out)[-1].double().log_softmax(-1)
        out.append(int(row.argmax()))
        lps.append(float(row[out[-1]]))
    return out, lps


def assert_like_hf(done: dict, want: dict, abs: float = 1e-3) -> None:
    """Each request's tokens are transformers' and so are their logprobs (asked for with
    ``logprobs=1``). Tokens alone are a weak check on a tiny random model, which repeats
    one token for long stretches whatever a wrong cache read does to its logits."""
    for rid, (tokens, lps) in want.items():
        assert done[rid].token_ids == tokens, rid
        assert [lp.logprob for lp in done[rid].logprobs] == pytest.approx(lps, abs=abs), rid


def assert_no_leaks(engine: LLMEngine) -> None:
    """Nothing of any request is left anywhere once the engine is idle."""
    assert not engine.has_unfinished()
    sched, kv = engine.core.scheduler, engine.core.kv_cache_manager
    assert not sched.requests and not sched.running and not sched.waiting
    assert kv.num_free_blocks == kv.num_total_blocks
    assert all(b.ref_count == 0 for b in kv.blocks)
    assert not kv.req_to_blocks and not kv._req_to_chain
    assert not engine.output_processor.parents and not engine.output_processor._parent_of
    assert engine.step() == []  # nothing left to run


# ---------------------------------------------------------------- text prompts for SmolLM2

CORPUS = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "small lamp and a notebook in which he wrote down the colour of the sky, the direction of "
    "the wind and the names of the ships that passed the point. In winter the storms came in "
    "from the west and the sea rose over the rocks, but the light never failed. Children from "
    "the village would visit on Sundays to hear his stories about sailors, whales and the "
    "great fog of the year the harbour froze. He taught them how to read the clouds, how to "
    "tie a bowline and why the moon pulls the tides twice a day. When the new electric beacon "
    "was installed, the keeper was told he could retire, yet he still walked up the hill each "
    "night to check that the beam swept the water as it should. Scientists measure the speed "
    "of light in a vacuum as almost three hundred thousand kilometres per second, and a "
    "photon from the sun needs a little more than eight minutes to reach the earth. A good "
    "recipe for bread needs flour, water, salt and yeast, and above all patience while the "
    "dough rises in a warm kitchen. Python is a programming language that lets you write "
    "clear programs quickly; its lists, dictionaries and functions are the first things most "
    "people learn. The capital of France is Paris, the capital of Japan is Tokyo, and the "
    "capital of Canada is Ottawa, which surprises many visitors who expect Toronto."
)


def text_prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths cut from CORPUS at varied offsets."""
    corpus_ids = tokenizer.encode(CORPUS, add_special_tokens=False)
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        assert n < len(corpus_ids)
        start = int(torch.randint(0, len(corpus_ids) - n + 1, (1,), generator=g))
        prompts.append(corpus_ids[start : start + n])
    return prompts
