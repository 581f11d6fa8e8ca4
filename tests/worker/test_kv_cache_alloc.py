"""The CPU KV cache: one zero-filled buffer, a contiguous (K, V) view pair per layer, advised
into transparent huge pages (a decode row's scattered blocks otherwise miss the TLB on
nearly every page), and the advice skipped where it cannot apply."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tinyserve.testing.checkpoints import llama_config
from tinyserve.worker import kv_cache
from tinyserve.worker.kv_cache import advise_huge_pages, allocate_kv_cache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """ "always", "madvise" or "never" (the bracketed word), None without THP."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _vm_flags(ptr: int) -> set[str]:
    """VmFlags of the mapping that holds address ``ptr`` (/proc/self/smaps); "hg": advised
    MADV_HUGEPAGE. (Whether the kernel then finds free 2 MiB pages depends on the machine's
    memory at that moment, so the advice is what is checked, not AnonHugePages.)"""
    inside, flags = False, set()
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "VmFlags:":
            flags = set(line.split()[1:])
    return flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_are_contiguous_zeroed_views_of_one_buffer(dtype):
    cfg = llama_config()
    kv = allocate_kv_cache(cfg, 37, 4, dtype)
    shape = (37, 4, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    assert len(kv) == cfg.num_hidden_layers
    ptrs = set()
    for k, v in kv:
        for t in (k, v):
            assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
            assert not t.any()
            ptrs.add(t.data_ptr())
    assert len(ptrs) == 2 * cfg.num_hidden_layers  # no two tensors alias
    kv[0][1].fill_(1)
    assert not kv[0][0].any() and not kv[1][0].any()  # writes stay in their tensor


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
                    reason="needs Linux transparent huge pages in madvise or always mode")  # fmt: skip
def test_a_big_cache_is_advised_into_huge_pages(monkeypatch):
    class Shape:  # SmolLM2's KV shape: 30 layers x 3 heads x 64
        num_key_value_heads, head_dim, num_hidden_layers = 3, 64, 30

    kv = allocate_kv_cache(Shape, 256, 16, torch.float32)  # 2 x 30 x 3 MiB
    assert "hg" in _vm_flags(kv[10][0].data_ptr())
    # Opted out, the advice is not given. (Asked of the call, not of the mapping: after
    # other tests malloc may hand out part of an old heap region that was advised before.)
    monkeypatch.setenv("TINYSERVE_HUGE_PAGES", "0")
    taken = []
    monkeypatch.setattr(kv_cache, "advise_huge_pages", lambda t: taken.append(advise_huge_pages(t)))
    allocate_kv_cache(Shape, 256, 16, torch.float32)
    assert taken == [False]


def _rss_bytes() -> int:
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_the_cache_is_resident_and_zero_from_the_start():
    """256 MiB of cache from a fresh mapping, each page touched once at allocation: resident
    at once (memory runs out at start-up, not mid-serving; RSS flat while the pool fills, as
    the soak test checks) and zero, and writes stay where they are made."""

    class Shape:
        num_key_value_heads, head_dim, num_hidden_layers = 4, 64, 16

    before = _rss_bytes()
    kv = allocate_kv_cache(Shape, 2048, 16, torch.float32)  # 2 x 16 x 8 MiB
    assert _rss_bytes() - before > 200 << 20
    k, v = kv[7]
    assert not k.any() and not v.any() and not kv[15][1].any()
    k[100:110].fill_(2.0)
    assert float(k.sum()) == 2.0 * k[100:110].numel() and not v.any()


def test_too_small_a_tensor_gets_no_advice():
    assert advise_huge_pages(torch.empty(16)) is False  # no whole 2 MiB page inside
