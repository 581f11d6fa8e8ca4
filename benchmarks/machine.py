"""What machine a benchmark ran on: recorded as ``"machine"`` in every results JSON.

    from machine import machine_info      # benchmarks/ is on sys.path for these scripts
    result["machine"] = machine_info()

CPU model, ISA flags and usable cores come from tinyserve.utils.cpu (the same facts the
kernels and the dtype calibration use; /proc/cpuinfo on Linux). The torch
version is read from the installed package's metadata, so a client-only script such as
bench_serving.py does not pay for importing torch.
"""

from __future__ import annotations

import os
import platform
import sys
import time

from tinyserve.utils.cpu import cpu_flags, cpu_model_name, usable_cpus  # torch-free

# The ISA extensions that decide which kernels a CPU inference stack can use.
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def _torch_version() -> str | None:
    if "torch" in sys.modules:
        return getattr(sys.modules["torch"], "__version__", None)
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("torch")
    except PackageNotFoundError:
        return None


def machine_info() -> dict:
    """CPU model, which ISA_FLAGS it has, core counts, torch version, date (UTC)."""
    model, flags = cpu_model_name(), cpu_flags()
    present = [f for f in ISA_FLAGS if f in flags]
    cores = os.cpu_count()
    usable = usable_cpus()
    torch_version = _torch_version()
    summary = f"{usable} cores, {model}, {' '.join(present) or 'no listed ISA flags'}"
    if torch_version:
        summary += f", torch {torch_version}"
    return {
        "cpu_model": model,
        "isa_flags": present,
        "cpu_count": cores,
        "usable_cores": usable,
        "arch": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "summary": summary,
    }


def describe(machine) -> str:
    """One line for a title: a results file's ``machine`` entry (a dict, or an old string)."""
    if isinstance(machine, dict):
        return machine.get("summary") or machine.get("cpu_model", "")
    return str(machine or "")


if __name__ == "__main__":
    import json

    print(json.dumps(machine_info(), indent=2))
