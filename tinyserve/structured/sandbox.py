"""Grammars are first compiled in a child process, so that one the grammar library cannot
survive takes down the child, never the server (issue 37).

Why: llguidance compiles by recursion over the grammar. A chain of 3,000 Lark rules
(``r0: r1 "x"``, ``r1: r2 "x"``, ...) or of 1,000 ``$ref``s in a JSON schema — 50-75 KB
request bodies — overflows an 8 MiB thread stack inside the library: a segfault that no
``except`` catches, which took the whole server down. Other shapes may do the same (or run
out of memory, or never finish) in ways we have not found.

How: ``GrammarSandbox.check(grammar)`` sends the grammar text (llguidance's own format, what
``GrammarBackend`` built from the request) to a child running this file as a script; the
child validates it (``LLMatcher.validate_grammar_with_warnings``, the library's full compile
without a tokenizer) on a thread with a ``CHILD_STACK_BYTES`` stack under a
``CHILD_MEMORY_BYTES`` address-space limit, and answers ``(is_error, messages)``. A child
that dies (a signal, an abort) is a ``GrammarCrash``; one that runs past the time limit is
killed (a real kill, unlike a thread) and a ``GrammarTimeout``. Either way the next check gets
a fresh child. Only a grammar that passed is compiled in the server process, on a thread
with ``COMPILE_STACK_BYTES`` (4x the child's: the same code path, measured 2.7-3.3 KB of stack
a level of rule nesting, so what passed in the child has 4x the room here).

Children are started when first needed (a ~60 ms start: the child imports llguidance and
the standard library only) and kept, at most one per concurrent check.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

CHILD_STACK_BYTES = 64 << 20
COMPILE_STACK_BYTES = 256 << 20
CHILD_MEMORY_BYTES = 8 << 30


class GrammarCrash(RuntimeError):
    """The child died compiling the grammar; ``str()`` says how."""


class GrammarTimeout(RuntimeError):
    """The child ran past the time limit and was killed."""


class _Child:
    """One child process, speaking one JSON line in and one JSON line out per grammar."""

    def __init__(self, limits: dict):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), json.dumps(limits)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self._buf = b""

    def ask(self, grammar: str, timeout_s: float) -> tuple[bool, list[str]]:
        try:
            self.proc.stdin.write(json.dumps({"grammar": grammar}).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise GrammarCrash(self._death()) from None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise GrammarTimeout(f"{timeout_s:g} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise GrammarCrash(self._death())
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        answer = json.loads(line)
        return bool(answer["error"]), list(answer["messages"])

    def _death(self) -> str:
        code = self.proc.wait(timeout=5)
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class GrammarSandbox:
    """Checks grammars in child processes. Thread-safe; ``check`` blocks its caller (a
    compile thread, never the engine thread) for at most ``timeout_s``."""

    def __init__(self, limits: dict, timeout_s: float):
        self._limits = dict(limits)
        self.timeout_s = timeout_s
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self._closed = False
        self.num_started = 0  # children started, replacements included
        self.num_crashes = 0
        self.num_timeouts = 0

    def check(self, grammar: str) -> tuple[bool, list[str]]:
        """``(is_error, messages)`` as llguidance's validate gives them. Raises GrammarCrash
        or GrammarTimeout; the child that did is gone and the next check starts another."""
        child = self._take()
        try:
            answer = child.ask(grammar, self.timeout_s)
        except GrammarCrash:
            with self._lock:
                self.num_crashes += 1
            child.kill()
            raise
        except BaseException:  # a timeout, or anything that leaves the child's state unknown
            with self._lock:
                self.num_timeouts += 1
            child.kill()
            raise
        with self._lock:
            if not self._closed:
                self._idle.append(child)
                return answer
        child.kill()
        return answer

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar sandbox is closed")
            if self._idle:
                return self._idle.pop()
            self.num_started += 1
        return _Child(self._limits)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


# ---------------------------------------------------------------------------- the child


def _serve(limits_json: str) -> None:
    """The child's loop: one JSON request a line on stdin, one answer a line on stdout, until
    stdin closes (the server exited or dropped this child)."""
    import resource

    import llguidance

    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    limits = llguidance.LLParserLimits(**json.loads(limits_json))
    threading.stack_size(CHILD_STACK_BYTES)
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        grammar = json.loads(line)["grammar"]
        answer: dict = {}

        def validate(grammar=grammar, answer=answer) -> None:
            try:
                is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                    grammar, None, limits=limits
                )
            except Exception as e:  # a library panic surfaces as an exception
                is_error, messages = True, [f"{type(e).__name__}: {e}"]
            answer.update(error=is_error, messages=[str(m) for m in messages])

        worker = threading.Thread(target=validate)
        worker.start()
        worker.join()
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
