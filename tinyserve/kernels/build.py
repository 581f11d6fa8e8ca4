"""Compile a kernel's C source once into the cache folder and load it with ctypes (whose
calls release the GIL).

Each source is built for one ISA level with the system C compiler, named by a hash of the
source and flags, so an edited kernel or another CPU never loads a stale library. Without a
compiler, on a CPU without the ISA, or with ``TINYSERVE_CPU_KERNELS=0``, :func:`load` returns
None (reason logged once) and callers keep their torch path.

Prebuilt: ``python -m tinyserve.kernels.build --out DIR`` compiles every kernel for every ISA
level into DIR (the Docker image does, at build time); ``$TINYSERVE_KERNEL_DIR`` (a
``os.pathsep`` list of such folders) is searched for the same file name before the cache
folder, so a container without a compiler still runs the kernels of its CPU's level.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tinyserve.utils.cache import cache_dir
from tinyserve.utils.cpu import AMX_FLAGS, amx_permitted, cpu_flags

logger = logging.getLogger(__name__)

_AVX2 = ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"])
_AVX512 = (
    _AVX2[0] | {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    _AVX2[1] + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
)
# ISA level -> (the /proc/cpuinfo flags it needs, compiler flags), best first. The sources
# pick their code by the compiler's macros: gemm.c's 16-lane groups under __AVX512F__ and its
# bf16-activation tiles under __AVX512BF16__, qgemm.c's dot products under __AVX512VNNI__; the
# rest is AVX2 code at every level.
_VNNI = (_AVX512[0] | {"avx512_vnni"}, _AVX512[1] + ["-mavx512vnni"])
_BF16 = (_VNNI[0] | {"avx512_bf16"}, _VNNI[1] + ["-mavx512bf16"])
ISA_LEVELS = {
    # + gemm.c's bf16 path on AMX tiles (gemm_amx.h); usable only once Linux granted this
    # process the tile state (utils/cpu.py amx_permitted)
    "amx": (_BF16[0] | AMX_FLAGS, _BF16[1] + ["-mamx-tile", "-mamx-bf16"]),
    "avx512_bf16": _BF16,
    "avx512_vnni": _VNNI,
    "avx512": _AVX512,
    "avx2": _AVX2,
}


def isa_level() -> str | None:
    """The best ISA level this CPU supports that we have kernels for, or the level named by
    ``$TINYSERVE_CPU_ISA`` (to compare levels on one machine) when this CPU has it."""
    usable = usable_levels()
    asked = os.environ.get("TINYSERVE_CPU_ISA")
    if asked:
        if asked not in ISA_LEVELS:
            raise ValueError(f"TINYSERVE_CPU_ISA={asked!r}: not one of {', '.join(ISA_LEVELS)}")
        if asked not in usable:
            logger.warning("TINYSERVE_CPU_ISA=%s: this CPU lacks it; using %s", asked,
                           usable[0] if usable else None)  # fmt: skip
        else:
            return asked
    return usable[0] if usable else None


def usable_levels() -> list[str]:
    """Every ISA level this CPU runs (the tests compare the kernels across them)."""
    return [level for level, (needs, _) in ISA_LEVELS.items()
            if needs <= cpu_flags() and (level != "amx" or amx_permitted())]  # fmt: skip


def kernels_enabled() -> bool:
    env = os.environ.get("TINYSERVE_CPU_KERNELS", os.environ.get("TINYSERVE_GGUF_KERNELS", "1"))
    return env != "0"


def _compile(source: Path, so_path: Path, flags: list[str]) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    so_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=so_path.parent) as tmp:
        out = Path(tmp) / so_path.name
        # -ffp-contract=off: the kernels spell out every FMA; the compiler must not fuse others
        # differently in different specialisations (batch invariance depends on it).
        cmd = [cc, "-O3", *flags, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
               "-o", str(out), str(source)]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        out.replace(so_path)  # atomic: concurrent builders never see half a file


def source_bytes(name: str, source_dir: Path | None = None) -> bytes:
    """kernels/<name>.c and every header beside it (simd.h, included by every kernel;
    gemm_common.h, gemm_bf16.h, ...), or those of ``source_dir`` (another revision's copy):
    what a build, or a measurement of one, depends on."""
    source = (source_dir or Path(__file__).parent) / f"{name}.c"
    return source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))


EMULATE_AMX = "-DTINYSERVE_AMX_EMULATE"  # gemm.c's AMX path on amx_tile.h's scalar tiles


def built(name: str, level: str | None = None, source_dir: Path | None = None,
          emulate_amx: bool = False) -> Path:  # fmt: skip
    """The library of kernels/<name>.c (or ``source_dir``'s copy) for ISA ``level`` (default:
    this CPU's), compiled once into the cache folder and named by a hash of its sources and
    flags: another revision or level, built by the tests or benchmarks/bench_kernels.py, is
    compiled once per machine like the native one (gemm.c takes ~30 s at -O3).
    ``emulate_amx``: gemm.c's AMX tiles emulated in scalar code (any level; the tests')."""
    level = level or isa_level()
    source_dir = source_dir or Path(__file__).parent
    flags = _flags(level, emulate_amx)
    file_name = _so_name(name, level, source_dir, emulate_amx)
    for folder in prebuilt_dirs():
        if (folder / file_name).is_file():
            return folder / file_name
    so_path = cache_dir() / "kernels" / file_name
    if not so_path.exists():
        _compile(source_dir / f"{name}.c", so_path, flags)
    return so_path


def _flags(level: str, emulate_amx: bool = False) -> list[str]:
    return ISA_LEVELS[level][1] + ([EMULATE_AMX] if emulate_amx else [])


def _so_name(name: str, level: str, source_dir: Path, emulate_amx: bool = False) -> str:
    flags = _flags(level, emulate_amx)
    digest = hashlib.sha256(source_bytes(name, source_dir) + " ".join(flags).encode())
    tag = "-amxemu" if emulate_amx else ""
    return f"{name}-{level}{tag}-{digest.hexdigest()[:16]}.so"


def prebuilt_dirs() -> list[Path]:
    """``$TINYSERVE_KERNEL_DIR``'s folders (``os.pathsep``-separated) of prebuilt kernels."""
    env = os.environ.get("TINYSERVE_KERNEL_DIR", "")
    return [Path(d).expanduser() for d in env.split(os.pathsep) if d]


def kernel_names() -> list[str]:
    """Every kernel source: kernels/<name>.c."""
    return sorted(p.stem for p in Path(__file__).parent.glob("*.c"))


def prebuild(out_dir: Path, levels: list[str] | None = None, jobs: int | None = None,
             names: list[str] | None = None) -> list[Path]:  # fmt: skip
    """Compile every kernel for every ISA level (default: all of ISA_LEVELS, whether or not
    this CPU runs them) into ``out_dir``, under the names :func:`built` looks for."""
    from concurrent.futures import ThreadPoolExecutor

    src = Path(__file__).parent
    todo = [(n, lv) for lv in (levels or list(ISA_LEVELS)) for n in (names or kernel_names())]
    out_dir.mkdir(parents=True, exist_ok=True)

    def one(item: tuple[str, str]) -> Path:
        name, level = item
        so_path = out_dir / _so_name(name, level, src)
        if not so_path.exists():
            _compile(src / f"{name}.c", so_path, _flags(level))
        return so_path

    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(one, todo))


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """``tinyserve/kernels/<name>.c`` compiled for this CPU, or None when unusable here."""
    if not kernels_enabled():
        return None
    level = isa_level()
    if level is None:
        logger.info("CPU kernels off: this CPU lacks AVX2/FMA/F16C")
        return None
    _log_level(level)
    try:
        return ctypes.CDLL(str(built(name, level)))
    except (OSError, RuntimeError) as e:
        logger.warning("CPU kernel %s off (torch path instead): %s", name, e)
        return None


@functools.cache
def _log_level(level: str) -> None:
    logger.info("CPU kernels built for %s", level)


_threads: int | None = None  # set_kernel_threads(); None: every usable CPU


def set_kernel_threads(n: int | None) -> None:
    """Cap the kernels' threads (tensor parallel gives each rank its share of the cores)."""
    global _threads
    _threads = n


def kernel_threads() -> int:
    """Threads for the kernels: $TINYSERVE_KERNEL_THREADS, else what set_kernel_threads()
    fixed, else one per CPU this process may use. Not torch.get_num_threads(): ``serve``
    sets MKL_NUM_THREADS=1, which also makes torch report a single thread."""
    return _threads_override() or _threads or _usable()


@functools.cache
def _threads_override() -> int:
    return int(os.environ.get("TINYSERVE_KERNEL_THREADS") or 0)


@functools.cache
def _usable() -> int:
    from tinyserve.utils.cpu import usable_cpus

    return usable_cpus()


def main(argv: list[str] | None = None) -> None:
    import argparse
    import time

    ap = argparse.ArgumentParser(prog="python -m tinyserve.kernels.build",
                                 description="Compile every CPU kernel for every ISA level "
                                 "into a folder for $TINYSERVE_KERNEL_DIR.")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True, help="folder for the .so files")
    ap.add_argument("--levels", nargs="+", choices=list(ISA_LEVELS), help="default: all")
    ap.add_argument("--kernels", nargs="+", choices=kernel_names(), help="default: all")
    ap.add_argument("--jobs", type=int, help="parallel compiles (default: one per CPU)")
    ap.add_argument("--cache", type=Path, help="compile into this folder, reusing what it "
                    "holds (a build cache), and copy the current set to --out")  # fmt: skip
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    paths = prebuild(args.cache or args.out, args.levels, args.jobs, args.kernels)
    if args.cache:
        args.out.mkdir(parents=True, exist_ok=True)
        paths = [Path(shutil.copy2(p, args.out / p.name)) for p in paths]
    size = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} kernels in {args.out} ({size / 1e6:.1f} MB, "
          f"{time.monotonic() - t0:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
