"""worker/contention.py: the kernel threads follow the cores other processes leave."""

from __future__ import annotations

import pytest

from tinyserve.worker import contention


@pytest.mark.parametrize(
    "cores,others,want",
    [(2, 0.0, 2), (2, 0.5, 2), (2, 0.8, 1), (2, 1.0, 1), (2, 1.9, 1), (4, 1.0, 3), (4, 2.8, 1),
     (1, 0.9, 1)],
)  # fmt: skip
def test_threads_left(cores, others, want):
    assert contention.threads_left(cores, others) == want


def test_the_governor_gives_up_a_thread_to_a_busy_neighbour_and_takes_it_back(monkeypatch):
    """Fake /proc/stat: busy CPU seconds by anyone vs this process's own, a clock stepping
    0.5 s a tick. Two looks in a row must agree before the count changes."""
    monkeypatch.delenv("TINYSERVE_KERNEL_THREADS", raising=False)
    monkeypatch.delenv("TINYSERVE_THREAD_GOVERNOR", raising=False)
    clock, busy, ours = [100.0], [0.0], [0.0]
    monkeypatch.setattr(contention.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(contention, "cpu_time_snapshot", lambda: (busy[0], ours[0]))
    calls = []
    monkeypatch.setattr(contention, "set_kernel_threads", calls.append)
    gov = contention.ThreadGovernor(max_threads=2, interval_s=0.5)
    assert gov.enabled

    def tick(our_cores: float, other_cores: float) -> None:
        clock[0] += 0.5
        ours[0] += 0.5 * our_cores
        busy[0] += 0.5 * (our_cores + other_cores)
        gov.tick()

    tick(1.9, 0.1)
    tick(1.8, 0.2)  # a quiet machine (a load generator beside us): nothing changes
    assert calls == [] and gov.threads == 2
    tick(1.0, 1.0)  # a busy neighbour: first look
    assert calls == []
    tick(1.0, 1.0)  # ... confirmed
    assert calls == [1] and gov.threads == 1
    tick(1.0, 1.0)
    tick(1.0, 0.0)  # it left
    tick(1.0, 0.0)
    assert calls == [1, 2] and gov.threads == 2
    gov.tick()  # within the interval: no look
    assert calls == [1, 2]
    tick(1.0, 1.0)
    tick(1.0, 1.0)
    assert calls == [1, 2, 1]
    clock[0] += 60  # idle a minute: that look decides nothing but starts again from all
    busy[0] += 60
    gov.tick()
    assert calls == [1, 2, 1, 2] and gov.threads == 2
    tick(1.9, 0.1)
    tick(1.9, 0.1)
    assert calls == [1, 2, 1, 2]  # quiet since: it stays
    tick(1.0, 1.0)
    tick(1.0, 1.0)  # the neighbour is still there: down again after two looks
    assert calls == [1, 2, 1, 2, 1]


def test_a_fixed_thread_count_or_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("TINYSERVE_KERNEL_THREADS", "2")
    assert not contention.ThreadGovernor(max_threads=2).enabled
    monkeypatch.delenv("TINYSERVE_KERNEL_THREADS")
    monkeypatch.setenv("TINYSERVE_THREAD_GOVERNOR", "0")
    assert not contention.ThreadGovernor(max_threads=2).enabled
    monkeypatch.delenv("TINYSERVE_THREAD_GOVERNOR")
    assert not contention.ThreadGovernor(max_threads=1).enabled  # one core: nothing to give up
