"""The compile pool: cache by spec, the time limit, failures that stay failures, and the
spec's canonical key. A fake backend stands in for the library (no tokenizer needed)."""

from __future__ import annotations

import threading
import time

import pytest

from tinyserve.structured.manager import GrammarCompilerPool
from tinyserve.structured.spec import StructuredOutputSpec


class FakeBackend:
    def __init__(self, slow: set[str] = frozenset(), delay: float = 2.0):
        self.calls: list[str] = []
        self.slow, self.delay = slow, delay
        self.release = threading.Event()

    def compile(self, spec):
        self.calls.append(spec.value)
        if spec.value in self.slow:
            self.release.wait(self.delay)
        if spec.value == "bad":
            raise ValueError(f"{spec.field}: invalid regex: bad")
        if spec.value == "boom":
            raise RuntimeError("library bug")
        return object()


def test_second_submit_returns_the_same_compiled_grammar():
    backend = FakeBackend()
    pool = GrammarCompilerPool(backend)
    first = pool.submit(StructuredOutputSpec.regex("a+")).result(5)
    again = pool.submit(StructuredOutputSpec.regex("a+")).result(5)
    assert again is first and backend.calls == ["a+"] and pool.num_compiles == 1
    pool.close()


def test_cache_evicts_least_recently_used():
    backend = FakeBackend()
    pool = GrammarCompilerPool(backend, cache_size=2)
    for pattern in ["a", "b", "a", "c", "a", "b"]:
        pool.submit(StructuredOutputSpec.regex(pattern)).result(5)
    assert backend.calls == ["a", "b", "c", "b"]  # "b" was evicted by "c"; "a" stayed
    pool.close()


def test_cache_evicts_past_its_bytes_too():
    """Entries are few but big: 100 grammar bytes each, 250 allowed -> two stay."""

    class Sized(FakeBackend):
        def compile(self, spec):
            super().compile(spec)
            return type("Compiled", (), {"grammar_bytes": 100})()

    backend = Sized()
    pool = GrammarCompilerPool(backend, cache_size=100, cache_bytes=250)
    for pattern in ["a", "b", "c", "c", "b", "a"]:
        pool.submit(StructuredOutputSpec.regex(pattern)).result(5)
    assert backend.calls == ["a", "b", "c", "a"]  # "a" went when "c" came; "b", "c" stayed
    assert pool.cached_bytes == 200
    pool.close()


def test_time_limit_fails_the_slow_compile_only():
    backend = FakeBackend(slow={"slow"}, delay=10)
    pool = GrammarCompilerPool(backend, max_workers=1, compile_timeout_s=0.2)
    slow = pool.submit(StructuredOutputSpec.regex("slow", field="structured_outputs.regex"))
    fast = pool.submit(StructuredOutputSpec.regex("fast"))
    with pytest.raises(ValueError, match=r"^structured_outputs.regex: .*within 0.2 s"):
        slow.result(5)
    assert fast.result(5) is not None  # the one worker was not held by the slow compile
    assert pool.num_abandoned == 1
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="within"):  # cached: no second background compile
        pool.submit(StructuredOutputSpec.regex("slow", field="structured_outputs.regex")).result(5)
    assert time.monotonic() - t0 < 0.1 and backend.calls.count("slow") == 1
    backend.release.set()
    deadline = time.monotonic() + 5
    while pool.num_abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.num_abandoned == 0
    pool.close()


def test_errors_are_value_errors_and_cached():
    backend = FakeBackend()
    pool = GrammarCompilerPool(backend)
    with pytest.raises(ValueError, match="^response_format: invalid regex"):
        pool.submit(StructuredOutputSpec.regex("bad")).result(5)
    with pytest.raises(ValueError, match="^response_format: could not compile: RuntimeError"):
        pool.submit(StructuredOutputSpec.regex("boom")).result(5)
    with pytest.raises(ValueError):
        pool.submit(StructuredOutputSpec.regex("bad")).result(5)
    assert backend.calls == ["bad", "boom"]
    pool.close()


def test_real_backend_through_the_pool(backend):
    pool = GrammarCompilerPool(backend)
    specs = [StructuredOutputSpec.json_schema({"type": "integer"}), StructuredOutputSpec.regex("x")]
    futures = [pool.submit(s) for s in specs]
    assert [f.result(30).spec for f in futures] == specs
    with pytest.raises(ValueError, match="unsupported JSON schema keyword '\\$dynamicRef'"):
        pool.submit(StructuredOutputSpec.json_schema({"$dynamicRef": "#x"})).result(30)
    pool.close()


def test_spec_keys_and_constructors():
    a = StructuredOutputSpec.json_schema({"type": "object", "properties": {}})
    b = StructuredOutputSpec.json_schema('{ "type" : "object", "properties" : {} }')
    assert a == b and a.key == b.key and hash(a) == hash(b)
    reordered = StructuredOutputSpec.json_schema({"properties": {}, "type": "object"})
    assert reordered.key != a.key  # property order is output order: a different grammar
    assert StructuredOutputSpec.choice(["x", "y"]).value == '["x","y"]'
    for bad in [
        lambda: StructuredOutputSpec("xml", "x"),
        lambda: StructuredOutputSpec.json_schema("{not json"),
        lambda: StructuredOutputSpec.json_schema([1]),
        lambda: StructuredOutputSpec.choice([]),
        lambda: StructuredOutputSpec.regex(""),
    ]:
        with pytest.raises(ValueError, match="^response_format: "):
            bad()


def _tb_len(e: BaseException) -> int:
    n, tb = 0, e.__traceback__
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


def test_a_cached_failure_is_read_not_re_raised(smollm2_tokenizer):
    """A failed compile is cached, and every request for that spec used to re-raise the same
    exception object: each raise extended its traceback and kept that request's frames
    alive (the 60-minute hostile soak grew 38% in RSS). Both ways to a compiled grammar now
    read the cached exception and raise a fresh ValueError."""
    import asyncio
    from types import SimpleNamespace

    from tinyserve.engine.async_engine import AsyncEngine
    from tinyserve.engine.structured_output import StructuredOutputManager
    from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams

    tok = smollm2_tokenizer
    manager = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,))
    bad = StructuredOutputsParams(json={"type": "object", "$dynamicRef": "#meta"})
    params = SamplingParams(structured_outputs=bad)
    with pytest.raises(ValueError, match="'\\$dynamicRef'"):
        manager.compiled(params)
    cached = manager.submit(params).exception()
    before = _tb_len(cached)
    engine = SimpleNamespace(engine=SimpleNamespace(compile_grammar=manager.submit))
    for _ in range(20):
        with pytest.raises(ValueError, match="'\\$dynamicRef'") as raised:
            manager.compiled(params)
        assert raised.value is not cached
        with pytest.raises(ValueError, match="'\\$dynamicRef'"):
            asyncio.run(AsyncEngine.prepare(engine, params))
    assert _tb_len(cached) == before
