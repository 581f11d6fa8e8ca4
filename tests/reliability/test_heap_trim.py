"""The heap trimming behind issue 37's RSS target (utils/memory.py): a trim gives back the
free pages a live chunk pins inside glibc's heap, the trimmer is rate-limited, the arena cap
keeps a user's MALLOC_ARENA_MAX, and the grammar pool trims after its compiles."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
import time

import pytest

from tinyserve.structured.manager import GrammarCompilerPool
from tinyserve.structured.spec import StructuredOutputSpec
from tinyserve.utils import memory
from tinyserve.utils.memory import HeapTrimmer

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="malloc_trim and mallopt(M_ARENA_MAX) are glibc's",
)

# 200 MiB of 4 KiB chunks (below the mmap threshold: they come from the heap); every 64th
# stays live, so the freed space lies between live chunks, not at the heap's top where free()
# would give it back by itself. RSS before and after trim_heap, in MiB.
PROBE = textwrap.dedent(
    """
    import ctypes, sys
    from tinyserve.utils.memory import trim_heap
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    chunks = []
    for _ in range(51_200):
        p = libc.malloc(4096)
        ctypes.memset(p, 1, 4096)
        chunks.append(p)
    for i, p in enumerate(chunks):
        if i % 64:
            libc.free(p)
    before = rss()
    trimmed = trim_heap() if sys.argv[1] == "trim" else None
    print(before, rss(), trimmed)
    """
)


def _probe(mode: str) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
        env={**os.environ, "MALLOC_ARENA_MAX": "1"},
    ).stdout.split()  # fmt: skip
    return float(out[0]), float(out[1])


@glibc
def test_trim_gives_back_free_pages_a_live_chunk_pins():
    before, after = _probe("keep")
    assert before > 150 and after > before - 20, (
        "without a trim glibc keeps the pages (the probe would prove nothing)"
    )
    before, after = _probe("trim")
    assert before - after > 150, f"trim gave back {before - after:.0f} of ~200 MiB"


def test_trimmer_trims_at_most_once_per_interval(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "trim_heap", lambda: calls.append(1) or True)
    now = [100.0]
    trimmer = HeapTrimmer(interval_s=30, clock=lambda: now[0])
    assert not trimmer.maybe_trim()  # the interval counts from the start
    now[0] += 30
    assert trimmer.maybe_trim() and not trimmer.maybe_trim()
    now[0] += 29.9
    assert not trimmer.maybe_trim()
    now[0] += 0.1
    assert trimmer.maybe_trim()
    assert len(calls) == trimmer.num_trims == 2


@glibc
def test_cap_arenas_keeps_the_users_setting(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert not memory.cap_arenas(4)
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert memory.cap_arenas(64)  # glibc's default bound on this machine is 8 per core: no change


def test_grammar_pool_trims_after_compiles():
    class Backend:
        def compile(self, spec, check=None):
            return object()

    class Counting(HeapTrimmer):
        def maybe_trim(self) -> bool:
            self.num_trims += 1
            return True

    trimmer = Counting(interval_s=0)
    pool = GrammarCompilerPool(Backend(), trimmer=trimmer)
    for pattern in ["a", "b", "a"]:
        pool.submit(StructuredOutputSpec.regex(pattern)).result(5)
    pool.close()
    deadline = time.monotonic() + 5
    while trimmer.num_trims < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert trimmer.num_trims == 2  # one per compile; the cache hit compiled nothing
