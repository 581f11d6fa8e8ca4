"""Kernel threads that follow the cores other processes leave us (issue 37).

The CPU kernels split every matmul and attention call over one OpenMP thread per usable core
and meet at a barrier at its end. When another process runs on one of those cores (a busy
neighbour, a build, a browser), the thread on it is descheduled for whole scheduler slices
and every barrier of a step waits for it: one stream of SmolLM2 fell from 163 to 5.4 tok/s
with a single `yes > /dev/null` on a 2-core machine (30x), where one thread on the free core
would keep more than half. Affinity masks and cgroup quotas are read at start-up
(utils/cpu.py usable_cpus); this handles what changes while the server runs.

``ThreadGovernor.tick()``, called once per step, looks every ``interval_s`` at how much of our
CPUs others took (utils/cpu.py: /proc/stat busy time minus this process's own) and, when two
looks in a row agree, sets the kernels' thread count to the cores left (at least one; back
to all of them when the others go). It never changes anything on a quiet machine, and
$TINYSERVE_KERNEL_THREADS (a fixed count) or TINYSERVE_THREAD_GOVERNOR=0 turns it off.
"""

from __future__ import annotations

import logging
import os
import time

from tinyserve.kernels.build import kernel_threads, set_kernel_threads
from tinyserve.utils.cpu import cpu_time_snapshot, others_cpu_seconds

logger = logging.getLogger(__name__)

# A core counts as taken when others used at least this share of it over the interval: a load
# generator or the server's own neighbours (~0.1-0.5 of a core) do not cost a thread.
TAKEN_SHARE = 0.75


def threads_left(max_threads: int, others_cores: float) -> int:
    """Kernel threads for ``max_threads`` usable cores of which others used ``others_cores``."""
    taken = int(others_cores + (1.0 - TAKEN_SHARE))
    return max(1, min(max_threads, max_threads - taken))


class ThreadGovernor:
    def __init__(self, max_threads: int | None = None, interval_s: float = 0.5) -> None:
        self.max_threads = max_threads or kernel_threads()
        self.interval_s = interval_s
        self.threads = self.max_threads
        self._t, self._snap = time.monotonic(), cpu_time_snapshot()
        self.enabled = (
            self.max_threads > 1
            and os.environ.get("TINYSERVE_THREAD_GOVERNOR", "1") != "0"
            and not os.environ.get("TINYSERVE_KERNEL_THREADS")
            and self._snap is not None
        )
        self._last_want: int | None = None

    def tick(self) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._t < self.interval_s:
            return
        snap = cpu_time_snapshot()
        others = others_cpu_seconds(self._snap, snap)
        elapsed, self._t, self._snap = now - self._t, now, snap
        if others is None or elapsed > 4 * self.interval_s:
            # Idle since the last look (no steps, no ticks): what others did then says nothing
            # about now. Start again with every thread and look over the next intervals: a
            # neighbour gone while we idled had kept one thread for the first 1-2 s of the
            # next burst (quiet one-stream runs after a contended one 157-162 vs 169-170 tok/s).
            self._last_want = None
            if self.threads != self.max_threads:
                self.threads = self.max_threads
                set_kernel_threads(self.max_threads)
            return
        want = threads_left(self.max_threads, others / elapsed)
        if want != self.threads and want == self._last_want:
            logger.info(
                "other processes took %.1f of %d cores: kernel threads %d -> %d",
                others / elapsed, self.max_threads, self.threads, want,
            )  # fmt: skip
            self.threads = want
            set_kernel_threads(want)
        self._last_want = want
