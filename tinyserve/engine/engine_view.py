"""EngineView: what the live engine view (``GET /v1/engine/events``) shows, step by step.

Plain Python, no torch. Read-only over the scheduler and the KV-cache manager, so it runs on
the engine thread only (the one thread that may read them). Costs nothing unwatched:
``records`` is None and the engine calls nothing here. Watched, the engine calls
``begin_step`` after ``schedule()`` and ``end_step`` once the step's outputs are processed,
and the engine thread asks for a ``snapshot`` at most every few hundred milliseconds.

The snapshot's format is a contract with the playground (docs/architecture.md, "Live engine
view"); fields may be added, never renamed or removed.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from tinyserve.engine.kv_cache_manager import KVCacheManager
from tinyserve.engine.scheduler import Scheduler
from tinyserve.outputs import SchedulerOutput
from tinyserve.request import Request

MAX_STEPS = 200  # step records kept between two snapshots (the oldest are dropped)
MAX_REQUESTS = 64  # requests listed in a snapshot


class EngineView:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager) -> None:
        self.scheduler = scheduler
        self.kv = kv
        # None: nobody watches, nothing is recorded. Else the steps since the last snapshot.
        self.records: deque[dict] | None = None
        self.num_dropped = 0  # step records dropped (over MAX_STEPS) since the last snapshot
        self._current: dict | None = None

    @property
    def watching(self) -> bool:
        return self.records is not None

    def watch(self, on: bool) -> None:
        """Start (keeping any records already taken) or stop recording steps."""
        if on and self.records is None:
            self.records = deque(maxlen=MAX_STEPS)
            self.num_dropped = 0
        elif not on:
            self.records = None
            self._current = None

    # -- per step (only while watched) -----------------------------------------------------------

    def begin_step(self, step: int, sched: SchedulerOutput) -> None:
        """Classify the step's rows as the model runner does: a request whose prompt is all
        computed is a decode row (1 token, plus drafts); any other is a prefill chunk."""
        decode, spec = 0, 0
        prefill = []
        for item in sched.scheduled:
            request = item.request
            spec += len(item.spec_token_ids)
            if request.num_computed_tokens >= request.num_prompt_tokens:
                decode += 1
            else:
                prefill.append({"id": request.request_id, "tokens": item.num_new_tokens})
        self._current = {
            "step": step,
            "ms": 0.0,
            "decode": decode,
            "prefill": prefill,
            "prefill_tokens": sum(p["tokens"] for p in prefill),
            "preempted": list(sched.preempted_request_ids),
            "spec_tokens": spec,
        }

    def end_step(self, ms: float) -> None:
        """Close the step's record with its wall time and the queues after it (what
        ``EngineStats`` reports at this step boundary)."""
        record, records = self._current, self.records
        self._current = None
        if record is None or records is None:
            return
        record["ms"] = round(ms, 3)
        record["running"] = self.scheduler.num_running
        record["waiting"] = self.scheduler.num_waiting
        record["kv_usage"] = self.kv.usage
        if len(records) == records.maxlen:
            self.num_dropped += 1
        records.append(record)

    # -- snapshots -------------------------------------------------------------------------------

    def snapshot(self, step: int, take_steps: bool = True, spec_decode=None) -> dict:
        """The queues, the KV pool and (``take_steps``) the steps recorded since the last
        snapshot that took them. ``spec_decode``: the proposer's SpecDecodeStats, or None."""
        sched, kv = self.scheduler, self.kv
        pool = kv.pool_map()
        total = kv.num_total_blocks
        free = kv.num_free_blocks
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        queued = itertools.chain(sched.running, sched.waiting)
        shown = [request_view(r, kv) for r in itertools.islice(queued, MAX_REQUESTS)]
        steps: list[dict] = []
        dropped = 0
        if take_steps and self.records:
            steps = list(self.records)
            self.records.clear()
            dropped, self.num_dropped = self.num_dropped, 0
        return {
            "time": time.time(),
            "step": step,
            "running": sched.num_running,
            "waiting": sched.num_waiting,
            "kv": {
                "block_size": kv.block_size,
                "total": total,
                "used": total - free,
                "free": free,
                "cached_free": pool.count("c"),
                "usage": kv.usage,
            },
            "prefix_cache": {
                "queries": queries,
                "hits": hits,
                "hit_rate": hits / queries if queries else 0.0,
            },
            "pool": pool,
            "requests": shown,
            "requests_truncated": sched.num_running + sched.num_waiting > MAX_REQUESTS,
            "steps": steps,
            "steps_dropped": dropped,
            "spec_decode": spec_decode_view(spec_decode),
        }


def request_view(request: Request, kv: KVCacheManager) -> dict:
    return {
        "id": request.request_id,
        "state": request.status.value,  # "running" | "waiting" | "preempted"
        "prompt_tokens": request.num_prompt_tokens,
        "computed_tokens": request.num_computed_tokens,
        "output_tokens": request.num_output_tokens,
        "cached_tokens": request.num_cached_tokens,
        "preemptions": request.num_preemptions,
        "blocks": kv.get_block_ids(request.request_id),
    }


def spec_decode_view(stats) -> dict | None:
    """Speculative decoding's cumulative counters (spec_decode/proposer.py SpecDecodeStats)."""
    if stats is None:
        return None
    drafted = stats.num_draft_tokens
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "acceptance_rate": stats.num_accepted_tokens / drafted if drafted else 0.0,
        "accepted_per_pos": list(stats.accepted_per_pos),
    }


def empty_snapshot(step: int = 0, num_blocks: int = 0, block_size: int = 16) -> dict:
    """A valid snapshot of an engine with nothing in it (engines without a KV pool: the
    tests' fake)."""
    return {
        "time": time.time(),
        "step": step,
        "running": 0,
        "waiting": 0,
        "kv": {
            "block_size": block_size,
            "total": num_blocks,
            "used": 0,
            "free": num_blocks,
            "cached_free": 0,
            "usage": 0.0,
        },
        "prefix_cache": {"queries": 0, "hits": 0, "hit_rate": 0.0},
        "pool": "." * num_blocks,
        "requests": [],
        "requests_truncated": False,
        "steps": [],
        "steps_dropped": 0,
        "spec_decode": None,
    }
