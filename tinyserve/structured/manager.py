"""Grammar compilation off the engine thread: a small pool, a cache by spec, a time limit.

``GrammarCompilerPool.submit(spec)`` returns a ``concurrent.futures.Future`` that resolves to
the ``CompiledGrammar`` or fails with a ``ValueError`` (a 400 for that request only): the
spec is unsupported or invalid, or its compile ran past ``compile_timeout_s``.

How the time limit works: each of the pool's ``max_workers`` workers runs one compile at a
time on a fresh daemon thread and waits for it at most ``compile_timeout_s``. Past that the
future fails and the worker moves on to the next queued compile; the over-long compile keeps
running in the background (Python cannot stop a thread, and the library does not take a
cancel) until the library's own limits end it. So a pathological spec costs one background
thread, never a worker: other compiles are not blocked. ``num_abandoned`` counts those still
running.

With a ``sandbox`` (sandbox.py, what the engine uses) a grammar is first compiled in a child
process that is killed past the limit and replaced after a crash, so a pathological spec
fails its request only and leaves no background thread (the wait here is then a backstop:
twice the limit); the compile in this process runs on a ``COMPILE_STACK_BYTES`` stack.

Caching: one future per ``spec.key``, least recently used evicted past ``cache_size`` entries
or ``cache_bytes`` of grammar text (a compiled grammar holds 60-72 bytes of memory per byte
of its text: a chain of 8,000 Lark rules, 142 KiB of text, holds 10 MiB; 4 MiB of text is
at most ~300 MiB of compiled grammars).
Failures are cached too (a spec that failed or timed out fails the same way again), so a
client resending a pathological spec does not start another background compile.

Memory: a compile allocates far more short-lived parser state than the grammar it leaves, on
a fresh thread's malloc arena, and glibc keeps those pages (RSS +19% over an hour of hostile
traffic). With a ``trimmer`` (utils/memory.py) each compile thread, after its result is out,
gives the heap's free pages back at most once per the trimmer's interval.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from tinyserve.structured.sandbox import (
    COMPILE_STACK_BYTES,
    GrammarCrash,
    GrammarSandbox,
    GrammarTimeout,
)
from tinyserve.structured.spec import StructuredOutputSpec
from tinyserve.utils.memory import HeapTrimmer
from tinyserve.utils.threads import start_thread


class _Compiles(Protocol):
    def compile(self, spec: StructuredOutputSpec, check=None): ...


class GrammarCompilerPool:
    def __init__(
        self,
        backend: _Compiles,
        max_workers: int = 2,
        cache_size: int = 256,
        compile_timeout_s: float = 10.0,
        cache_bytes: int = 4 << 20,
        sandbox: GrammarSandbox | None = None,
        trimmer: HeapTrimmer | None = None,
    ):
        self._backend = backend
        self._sandbox = sandbox
        self._trimmer = trimmer
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._sizes: dict[str, int] = {}  # grammar_bytes of the compiled entries
        self.cached_bytes = 0
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()
        self._abandoned = 0
        self.num_compiles = 0  # compiles started (cache misses)

    @property
    def num_abandoned(self) -> int:
        """Compiles that ran past the limit and are still running in the background."""
        with self._lock:
            return self._abandoned

    def submit(self, spec: StructuredOutputSpec) -> Future:
        """The compiled grammar for ``spec``, from the cache or compiled on the pool. Safe
        from any thread; never blocks on a compile."""
        key = spec.key  # built once: it holds the whole spec text (up to 256,000 characters)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = Future()
            self._cache[key] = future
            self._evict()
            self.num_compiles += 1
        self._executor.submit(self._run, spec, key, future)
        return future

    def _evict(self) -> None:
        """Drop least recently used entries past either bound (under the lock); the newest
        entry stays whatever its size."""
        while len(self._cache) > 1 and (
            len(self._cache) > self._cache_size or self.cached_bytes > self._cache_bytes
        ):
            key, _ = self._cache.popitem(last=False)
            self.cached_bytes -= self._sizes.pop(key, 0)

    def _charge(self, key: str, future: Future, result) -> None:
        """Count a compiled grammar's bytes while its entry is still cached."""
        with self._lock:
            if self._cache.get(key) is future:
                self._sizes[key] = getattr(result, "grammar_bytes", 0)
                self.cached_bytes += self._sizes[key]
                self._evict()

    def _run(self, spec: StructuredOutputSpec, key: str, future: Future) -> None:
        """On a pool worker: compile on a daemon thread, wait for it at most the limit."""
        done = threading.Event()
        abandoned = [False]  # set under the lock when the limit passes first

        def compile_it() -> None:
            try:
                if self._sandbox is None:
                    result = self._backend.compile(spec)
                else:
                    result = self._backend.compile(spec, check=self._sandbox.check)
            except ValueError as e:
                _settle(future, error=e)
            except GrammarTimeout:
                _settle(future, error=ValueError(f"{spec.field}: {over_limit}"))
            except GrammarCrash as e:
                crashed = f"the grammar library crashed compiling it ({e}): too deep or too large"
                _settle(future, error=ValueError(f"{spec.field}: {crashed}"))
            except BaseException as e:  # a library panic or bug fails this request only
                _settle(future, error=ValueError(f"{spec.field}: could not compile: {e!r}"))
            else:
                _settle(future, result=result)
                self._charge(key, future, result)
            finally:
                done.set()
                with self._lock:
                    if abandoned[0]:
                        self._abandoned -= 1
                if self._trimmer is not None:
                    self._trimmer.maybe_trim()

        over_limit = f"grammar did not compile within {self.compile_timeout_s:g} s"
        start_thread(compile_it, "grammar-compile-job", COMPILE_STACK_BYTES)
        backstop = self.compile_timeout_s * (1 if self._sandbox is None else 2)
        if done.wait(backstop):
            return
        with self._lock:
            if not done.is_set():
                abandoned[0] = True
                self._abandoned += 1
        _settle(future, error=ValueError(f"{spec.field}: {over_limit}"))

    def close(self) -> None:
        """Stop taking compiles; queued ones are cancelled, running ones are not waited for."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._sandbox is not None:
            self._sandbox.close()


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless it already is (the time limit and the compile race)."""
    if future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except Exception:  # resolved by the other side between the check and the set
        pass
