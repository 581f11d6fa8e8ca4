"""Grammars the library cannot survive fail their request, not the server (issue 37): the
compile sandbox's child dies or is killed instead, and the next grammar gets a fresh one.

The premise is checked, not assumed: each crashing grammar here is first run the old way
(the library's compile on an ordinary 8 MiB thread, in a throwaway process) and must kill
that process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import llguidance
import pytest

from tinyserve.structured.backend import PARSER_LIMITS
from tinyserve.structured.manager import GrammarCompilerPool
from tinyserve.structured.sandbox import GrammarCrash, GrammarSandbox, GrammarTimeout
from tinyserve.structured.spec import StructuredOutputSpec
from tinyserve.testing.schemas import ref_chain, rule_chain


def lark_text(grammar: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(grammar)


def schema_text(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))


def compile_unsandboxed(grammar_text: str) -> int:
    """The exit status of a process that validates ``grammar_text`` on a default thread."""
    code = textwrap.dedent(
        """
        import sys, threading, llguidance
        from tinyserve.structured.backend import PARSER_LIMITS
        text = sys.stdin.read()
        limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        check = lambda: llguidance.LLMatcher.validate_grammar_with_warnings(text, None, limits=limits)
        t = threading.Thread(target=check); t.start(); t.join()
        """
    )
    run = subprocess.run([sys.executable, "-c", code], input=grammar_text.encode(), timeout=120)
    return run.returncode


@pytest.fixture
def sandbox():
    box = GrammarSandbox(PARSER_LIMITS, timeout_s=60.0)
    yield box
    box.close()


def test_a_grammar_that_kills_a_thread_kills_only_the_child(sandbox):
    deadly = lark_text(rule_chain(30_000))
    assert compile_unsandboxed(deadly) == -signal.SIGSEGV  # the premise
    assert sandbox.check(lark_text('start: "a"+')) == (False, [])
    with pytest.raises(GrammarCrash, match="SIGSEGV"):
        sandbox.check(deadly)
    assert sandbox.num_crashes == 1
    assert sandbox.check(lark_text('start: "b"+')) == (False, [])  # a fresh child
    assert sandbox.num_started == 2
    is_error, messages = sandbox.check(lark_text("start: nope"))
    assert is_error and "nope" in messages[0]


def test_a_child_past_the_time_limit_is_killed_and_replaced(sandbox):
    sandbox.check(lark_text('start: "a"'))  # started and warm
    (child,) = sandbox._idle
    sandbox.timeout_s = 1e-4
    with pytest.raises(GrammarTimeout):
        sandbox.check(lark_text(rule_chain(10_000)))
    assert child.proc.poll() is not None  # killed, not left running
    sandbox.timeout_s = 60.0
    assert sandbox.check(lark_text('start: "a"')) == (False, [])
    assert sandbox.num_timeouts == 1 and sandbox.num_started == 2


def test_close_stops_the_children():
    box = GrammarSandbox(PARSER_LIMITS, timeout_s=60.0)
    box.check(lark_text('start: "a"'))
    (child,) = box._idle
    box.close()
    assert child.proc.poll() is not None
    with pytest.raises(RuntimeError, match="closed"):
        box.check(lark_text('start: "a"'))


@pytest.fixture
def pool(backend):
    pool = GrammarCompilerPool(backend, sandbox=GrammarSandbox(PARSER_LIMITS, timeout_s=60.0))
    yield pool
    pool.close()


def test_the_pool_compiles_what_crashed_the_server_and_refuses_what_crashes_the_child(pool):
    """A 3,000-rule chain and a 1,000-$ref chain (50-75 KB bodies) crashed the server's
    compile thread; now they compile (4x the stack). A 30,000-rule chain is a 400."""
    for spec, text in [
        (StructuredOutputSpec.grammar(rule_chain(3000), "grammar"), lark_text(rule_chain(3000))),
        (StructuredOutputSpec.json_schema(ref_chain(1000)), schema_text(ref_chain(1000))),
    ]:
        assert compile_unsandboxed(text) == -signal.SIGSEGV  # the premise
        assert pool.submit(spec).result(120).spec == spec
    deadly = StructuredOutputSpec.grammar(rule_chain(30_000), "structured_outputs")
    with pytest.raises(ValueError, match=r"^structured_outputs: the grammar library crashed"):
        pool.submit(deadly).result(120)
    assert pool.submit(StructuredOutputSpec.regex("[0-9]+")).result(60) is not None
