"""Threads with a stack of a chosen size.

``threading.stack_size`` sets the size for every thread started after it, process-wide; this
sets it, starts one thread and puts it back, under a lock so two callers do not mix theirs.
A thread started elsewhere in that window gets the larger stack: address space, not memory
(pages are touched only as the stack grows), so that race costs nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_lock = threading.Lock()


def start_thread(
    target: Callable[[], object], name: str, stack_bytes: int, daemon: bool = True
) -> threading.Thread:
    """Start ``target`` on a new thread with a ``stack_bytes`` stack."""
    with _lock:
        old = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=target, name=name, daemon=daemon)
            thread.start()
        finally:
            threading.stack_size(old)
    return thread
