"""This tree beside a baseline revision (a detached git worktree), for the A/B benchmarks
that run each tree in its own process (bench_long_context.py, bench_load_memory.py)."""

from __future__ import annotations

import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def this_tree_and(rev: str, prefix: str):
    """-> (a scratch folder, {"this tree (HEAD+)": ROOT, "baseline REV": its worktree});
    the worktree is removed on leaving."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    base = work / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), rev], cwd=ROOT, check=True,
                   capture_output=True)  # fmt: skip
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True, check=True).stdout.strip()  # fmt: skip
    try:
        yield work, {f"this tree ({head}+)": ROOT, f"baseline {rev}": base}
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
