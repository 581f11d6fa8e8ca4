"""Facts about the CPU we run on: ISA flags, model name, usable cores."""

from __future__ import annotations

import functools
import os


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ``flags`` line of /proc/cpuinfo (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})  # /proc/cpuinfo's, for the bf16 tiles


@functools.cache
def amx_permitted() -> bool:
    """Whether this process may use AMX tiles: the CPU lists ``amx_tile`` and ``amx_bf16`` and
    Linux granted the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``,
    per process, its threads included). Without the grant the first tile instruction faults."""
    if not AMX_FLAGS <= cpu_flags() or os.uname().machine != "x86_64":
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, 18


@functools.cache
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@functools.cache
def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota
    (containers), not ``os.cpu_count()`` (every CPU of the host)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        n = min(n, max(1, int(quota)))
    return max(1, n)


def cgroup_cpu_quota() -> float | None:
    """The CPU quota, in cores, of this process's cgroup or a parent of it (the smallest),
    cgroup v2 (cpu.max) or v1 (cpu.cfs_quota_us / cpu.cfs_period_us); None without one. A
    container's own group is its mount's root; a process moved into a child group (systemd,
    an operator's `cgcreate`) has its quota there."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            root, files = "/sys/fs/cgroup", ("cpu.max",)
        elif "cpu" in controllers.split(","):  # v1
            root, files = "/sys/fs/cgroup/cpu", ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts), -1, -1):
            folder = "/".join([root, *parts[:i]])
            try:
                values = [open(f"{folder}/{f}").read().split() for f in files]
            except OSError:
                continue
            quota, period = (values[0][:2] if len(files) == 1 else (values[0][0], values[1][0]))
            if quota not in ("max", "-1"):
                found.append(int(quota) / int(period))
    return min(found) if found else None


def cpu_time_snapshot() -> tuple[float, float] | None:
    """(CPU seconds spent busy so far on the CPUs this process may run on, by anyone —
    hypervisor steal included; CPU seconds this process has used), or None where
    /proc/stat is not there. Two snapshots tell how much of those CPUs others took meanwhile
    (``others_cpu_seconds``)."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = None
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if not name[3:].isdigit():
                    break
                if allowed is not None and int(name[3:]) not in allowed:
                    continue
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                busy += user + nice + system + irq + softirq + steal
    except (OSError, ValueError):
        return None
    t = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system


def others_cpu_seconds(before: tuple[float, float] | None, after: tuple[float, float] | None):
    """CPU seconds that other processes (and the hypervisor) took from our CPUs between two
    ``cpu_time_snapshot``s; None if either is unknown."""
    if before is None or after is None:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1]))
