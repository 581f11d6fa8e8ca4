"""StructuredOutputManager: the engine's side of constrained decoding.

* Compiling: a request's grammar (JSON schema, JSON object, regex, choice, grammar) is
  compiled by ``structured.manager.GrammarCompilerPool`` — a small thread pool, cached by
  spec, with a time limit — never on the engine thread. The async front awaits the compile
  before it adds the request (a spec that fails or times out is a 400 before anything
  streams; other requests run meanwhile); the offline path compiles in ``add_request``.
* Matching: each child request (``n > 1`` included) gets its own matcher
  (``Request.grammar``); the scheduler advances it with every token it appends (so it
  follows the kept output tokens through preemption by recompute) and finishes the request
  when the grammar is complete.
* Masking: after ``schedule()``, ``fill_bitmask`` fills one bitmask row per constrained
  request that samples this step; the sampler applies it before every other logits stage.

The grammar backend (the tokenizer's vocabulary converted for llguidance) is built once per
tokenizer and process, in a background thread (from the server's start, or at the first
constrained request).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from tinyserve.outputs import SchedulerOutput
from tinyserve.request import Request
from tinyserve.sampling_params import SamplingParams

# Building a backend converts the tokenizer's vocabulary for the grammar library (~2-4 s for
# 49k tokens on 2 cores): done once per tokenizer and process, in the background from the
# server's start (``warm_up``), so its first constrained request does not wait for it.
_BUILDER = ThreadPoolExecutor(1, thread_name_prefix="grammar-backend")
_BACKENDS: dict[tuple, Future] = {}
_BACKENDS_LOCK = threading.Lock()


def _backend_future(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Future:
    key = (getattr(tokenizer, "name_or_path", None) or id(tokenizer), len(tokenizer),
           vocab_size, eos_token_ids)  # fmt: skip
    with _BACKENDS_LOCK:
        future = _BACKENDS.get(key)
        if future is None:
            from tinyserve.structured.backend import GrammarBackend

            eos = list(eos_token_ids) or None
            future = _BACKENDS[key] = _BUILDER.submit(GrammarBackend, tokenizer, vocab_size, eos)
        return future


class StructuredOutputManager:
    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids=(), compile_timeout: float = 10.0
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self.eos_token_ids = tuple(eos_token_ids)
        self._backend = None
        self._pool = None

    def warm_up(self) -> None:
        """Start building the grammar backend in the background (the server does at start;
        otherwise the first constrained request builds it)."""
        if self.tokenizer is not None:
            _backend_future(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def _ensure_pool(self):
        if self._pool is None:
            from tinyserve.structured.backend import PARSER_LIMITS
            from tinyserve.structured.manager import GrammarCompilerPool
            from tinyserve.structured.sandbox import GrammarSandbox
            from tinyserve.utils.memory import HeapTrimmer

            future = _backend_future(self.tokenizer, self.vocab_size, self.eos_token_ids)
            self._backend = future.result()
            sandbox = GrammarSandbox(PARSER_LIMITS, self.compile_timeout)
            self._pool = GrammarCompilerPool(
                self._backend,
                compile_timeout_s=self.compile_timeout,
                sandbox=sandbox,
                trimmer=HeapTrimmer(),
            )
        return self._pool

    @staticmethod
    def _spec(params: SamplingParams):
        from tinyserve.structured.spec import StructuredOutputSpec

        so, spec = params.structured_outputs, StructuredOutputSpec
        if so.json is not None:
            return spec.json_schema(so.json, so.field)
        if so.regex is not None:
            return spec.regex(so.regex, so.field)
        if so.choice is not None:
            return spec.choice(so.choice, so.field)
        if so.grammar is not None:
            return spec.grammar(so.grammar, so.field)
        return spec.json_object(so.field)

    def validate(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError(
                "structured_outputs: constrained decoding needs a tokenizer, and this engine has none"
            )

    def submit(self, params: SamplingParams) -> Future | None:
        """Start (or find in the cache) the compile of the request's grammar; thread-safe.
        None for an unconstrained request. The future raises ValueError for a bad spec."""
        if params.structured_outputs is None:
            return None
        self.validate(params)
        return self._ensure_pool().submit(self._spec(params))

    def compiled(self, params: SamplingParams):
        """The request's compiled grammar, or None (blocks while it compiles: the async front
        has already awaited it and kept it on ``params``). Raises ValueError for a bad spec."""
        if params.compiled_grammar is not None:
            return params.compiled_grammar
        future = self.submit(params)
        if future is None:
            return None
        if (error := future.exception()) is not None:  # read, never re-raised
            raise fresh_error(error)
        return future.result()

    def attach(self, compiled, children: list[Request]) -> None:
        """Give each child its own matcher over the compiled grammar."""
        if compiled is None:
            return
        for req in children:
            req.grammar = self._backend.matcher(compiled)
            so = req.sampling_params.structured_outputs
            if so is not None and so.think_end_id is not None:
                from tinyserve.structured.thinking import ThinkingGate

                req.grammar = ThinkingGate(
                    req.grammar, so.think_start_id, so.think_end_id, so.thinking_open
                )

    def fill_bitmask(self, sched: SchedulerOutput) -> None:
        """One allowed-token bitmask row per constrained request that samples this step, and
        with speculative drafts one per verified position (``grammar_rows`` holds the first):
        row j is the mask after the first j drafts (a fork of the matcher walks over them).
        Past a draft the grammar rejects, rows are never used (that draft's own row forbids
        it, so verification stops there) and repeat the last real one."""
        items = [it for it in sched.scheduled if it.samples and it.request.grammar is not None]
        if not items:
            return
        num_rows = sum(1 + len(it.spec_token_ids) for it in items)
        bitmask = self._backend.allocate_bitmask(num_rows)
        rows, row = {}, 0
        for it in items:
            rows[it.request.request_id] = row
            _fill_with_drafts(it.request.grammar, it.spec_token_ids, bitmask, row)
            row += 1 + len(it.spec_token_ids)
        sched.grammar_rows = rows
        sched.grammar_bitmask = bitmask


def _fill_with_drafts(grammar, drafts: list[int], bitmask, row: int) -> None:
    grammar.fill_bitmask(bitmask, row)
    # The drafts are walked on a fork, thrown away after: the request's matcher only moves
    # forward. Walked on it and rolled back, the library's mask cache kept a draft's state
    # and a later state with the same key got its mask (Matcher.rollback).
    probe = grammar.fork() if drafts else None
    walking = True
    for j, token_id in enumerate(drafts, start=1):
        walking = walking and probe.accept_tokens([token_id])
        if walking:
            probe.fill_bitmask(bitmask, row + j)
        else:
            bitmask[row + j] = bitmask[row + j - 1]


def fresh_error(e: BaseException) -> ValueError:
    """A new ValueError with ``e``'s message. A failed compile's future is cached, and every
    request asking for that spec re-raised the same exception object: each raise extended
    its traceback, keeping every such request's frames (bodies, prompts) alive — the hostile
    grammar soak's memory growth (issue 37). The cached exception is read, never raised."""
    if not isinstance(e, ValueError):  # the pool settles only ValueErrors; anything else is ours
        raise e
    return ValueError(str(e))
