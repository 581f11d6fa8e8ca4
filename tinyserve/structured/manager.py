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

Caching: one future per ``spec.key``, least recently used evicted past ``cache_size``.
Failures are cached too (a spec that failed or timed out fails the same way again), so a
client resending a pathological spec does not start another background compile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from tinyserve.structured.spec import StructuredOutputSpec


class _Compiles(Protocol):
    def compile(self, spec: StructuredOutputSpec): ...


class GrammarCompilerPool:
    def __init__(
        self,
        backend: _Compiles,
        max_workers: int = 2,
        cache_size: int = 256,
        compile_timeout_s: float = 10.0,
    ):
        self._backend = backend
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_size = cache_size
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
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = Future()
            self._cache[spec.key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self.num_compiles += 1
        self._executor.submit(self._run, spec, future)
        return future

    def _run(self, spec: StructuredOutputSpec, future: Future) -> None:
        """On a pool worker: compile on a daemon thread, wait for it at most the limit."""
        done = threading.Event()
        abandoned = [False]  # set under the lock when the limit passes first

        def compile_it() -> None:
            try:
                result = self._backend.compile(spec)
            except ValueError as e:
                _settle(future, error=e)
            except BaseException as e:  # a library panic or bug fails this request only
                _settle(future, error=ValueError(f"{spec.field}: could not compile: {e!r}"))
            else:
                _settle(future, result=result)
            finally:
                done.set()
                with self._lock:
                    if abandoned[0]:
                        self._abandoned -= 1

        threading.Thread(target=compile_it, name="grammar-compile-job", daemon=True).start()
        if done.wait(self.compile_timeout_s):
            return
        with self._lock:
            if not done.is_set():
                abandoned[0] = True
                self._abandoned += 1
        limit = f"{self.compile_timeout_s:g} s"
        _settle(future, error=ValueError(f"{spec.field}: grammar did not compile within {limit}"))

    def close(self) -> None:
        """Stop taking compiles; queued ones are cancelled, running ones are not waited for."""
        self._executor.shutdown(wait=False, cancel_futures=True)


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
