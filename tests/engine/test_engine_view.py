"""The live engine view's engine side (engine/engine_view.py): snapshots of a real (tiny)
engine show the queues and the KV pool as the scheduler and the KV-cache manager hold them,
step records match what the scheduler scheduled, and unwatched the engine builds nothing."""

from __future__ import annotations

import asyncio

from tests.support.engine import drain, greedy, random_prompt, record_schedules, tiny_engine
from tinyserve.engine.async_engine import AsyncEngine

BLOCK = 4  # tiny_engine's block size


def _blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)


def _run_watched(engine, requests: dict, after_each_step):
    """Watch, add ``{id: (prompt length, seed, max_tokens)}``, step to the end; returns the
    SchedulerOutputs and ``after_each_step()``'s result for each step."""
    schedules = record_schedules(engine)
    engine.watch(True)
    for rid, (n, seed, max_tokens) in requests.items():
        engine.add_request(rid, random_prompt(n, seed), greedy(max_tokens))
    results = []
    while engine.has_unfinished():
        engine.step()
        results.append(after_each_step())
    return schedules, results


def test_snapshot_counts_requests_and_pool(tiny_qwen2_path):
    engine = tiny_engine(tiny_qwen2_path, num_blocks=64, max_num_seqs=2)
    prompts = {"a": random_prompt(10, 1), "b": random_prompt(13, 2), "c": random_prompt(7, 3)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(5))
    engine.step()  # a and b are admitted and prefilled whole; c waits (max_num_seqs=2)
    snap = engine.snapshot()
    stats = engine.stats()
    assert (snap["running"], snap["waiting"]) == (2, 1)
    assert (snap["running"], snap["waiting"]) == (stats.num_running, stats.num_waiting)
    assert snap["step"] == stats.num_steps == 1
    assert [(r["id"], r["state"]) for r in snap["requests"]] == [
        ("a", "running"), ("b", "running"), ("c", "waiting"),
    ]  # fmt: skip
    by_id = {r["id"]: r for r in snap["requests"]}
    for rid in ("a", "b"):
        n = len(prompts[rid])
        assert by_id[rid]["prompt_tokens"] == by_id[rid]["computed_tokens"] == n
        assert by_id[rid]["output_tokens"] == 1
        assert len(by_id[rid]["blocks"]) == _blocks_for(n)
    assert by_id["c"]["blocks"] == [] and by_id["c"]["computed_tokens"] == 0
    held = _blocks_for(10) + _blocks_for(13)
    kv = snap["kv"]
    assert kv["total"] == len(snap["pool"]) == 64 and kv["block_size"] == BLOCK
    assert kv["used"] == held == snap["pool"].count("u") and snap["pool"].count("s") == 0
    assert kv["free"] == 64 - held and kv["usage"] == held / 64 == stats.kv_cache_usage
    for rid in ("a", "b"):
        assert all(snap["pool"][b] == "u" for b in by_id[rid]["blocks"])
    assert snap["requests_truncated"] is False
    drain(engine)


def test_shared_prefix_shows_shared_then_cached_blocks(tiny_qwen2_path):
    engine = tiny_engine(tiny_qwen2_path, num_blocks=64)
    prompt = random_prompt(21, 7)  # 5 full blocks a second request can hit (not the last token)
    engine.add_request("first", prompt, greedy(3))
    engine.step()
    engine.add_request("second", prompt, greedy(3))
    engine.step()
    snap = engine.snapshot()
    first, second = snap["requests"]
    shared = (len(prompt) - 1) // BLOCK
    assert second["cached_tokens"] == shared * BLOCK
    assert first["blocks"][:shared] == second["blocks"][:shared]
    assert snap["pool"].count("s") == shared
    assert all(snap["pool"][b] == "s" for b in first["blocks"][:shared])
    assert all(snap["pool"][b] == "u" for b in first["blocks"][shared:] + second["blocks"][shared:])
    assert snap["prefix_cache"]["hits"] == shared * BLOCK
    assert snap["prefix_cache"]["queries"] == 2 * len(prompt)
    assert snap["prefix_cache"]["hit_rate"] == shared * BLOCK / (2 * len(prompt))
    drain(engine)
    done = engine.snapshot()
    kv = engine.core.kv_cache_manager
    hashed = [b.block_id for b in kv.blocks if b.block_hash is not None]
    assert len(hashed) >= shared and done["running"] == done["waiting"] == 0
    assert done["kv"]["cached_free"] == done["pool"].count("c") == len(hashed)
    assert all(done["pool"][b] == "c" for b in first["blocks"][:shared])
    assert done["pool"].count(".") == 64 - len(hashed) and done["kv"]["used"] == 0


def test_step_records_match_the_schedule(tiny_qwen2_path):
    engine = tiny_engine(tiny_qwen2_path, num_blocks=64, max_num_batched_tokens=16)

    def counts():
        stats = engine.stats()
        return stats.num_running, stats.num_waiting, stats.kv_cache_usage

    schedules, after_step = _run_watched(engine, {"a": (30, 4, 3), "b": (9, 5, 3)}, counts)
    steps = engine.snapshot()["steps"]
    assert [s["step"] for s in steps] == list(range(1, len(schedules) + 1))
    # Budget 16: a's prompt in chunks of 16 and 14, b's 9 tokens start in the second step.
    assert [p for s in steps[:3] for p in s["prefill"]] == [
        {"id": "a", "tokens": 16}, {"id": "a", "tokens": 14}, {"id": "b", "tokens": 2},
        {"id": "b", "tokens": 7},
    ]  # fmt: skip
    assert [s["decode"] for s in steps[:3]] == [0, 0, 1]
    # Each request samples its first token with its last prompt chunk, then decodes twice.
    assert sum(s["decode"] for s in steps) == 2 + 2
    assert sum(s["prefill_tokens"] for s in steps) == 30 + 9
    for record, sched in zip(steps, schedules, strict=True):
        assert record["decode"] + len(record["prefill"]) == len(sched.scheduled)
        ids = {p["id"] for p in record["prefill"]}
        assert ids <= {item.request.request_id for item in sched.scheduled}
        assert record["preempted"] == sched.preempted_request_ids == []
        assert record["spec_tokens"] == 0 and record["ms"] > 0
    assert [(s["running"], s["waiting"], s["kv_usage"]) for s in steps] == after_step
    assert engine.snapshot()["steps"] == []  # taken by the first snapshot


def test_preemption_is_recorded(tiny_qwen2_path):
    # 8 blocks of 4 = 32 tokens; two requests of 10 + 12 tokens (6 blocks each) do not fit.
    engine = tiny_engine(tiny_qwen2_path, num_blocks=8)
    requests = {"x": (10, 8, 12), "y": (10, 9, 12)}
    schedules, snaps = _run_watched(engine, requests, engine.snapshot)
    preempted = [s.preempted_request_ids for s in schedules]
    assert any(preempted)
    assert [rec["preempted"] for snap in snaps for rec in snap["steps"]] == preempted
    victim = next(ids for ids in preempted if ids)[0]
    states = [r["state"] for snap in snaps for r in snap["requests"] if r["id"] == victim]
    assert "preempted" in states
    assert all(len(s["pool"]) == 8 and s["kv"]["used"] <= 8 for s in snaps)


def test_unwatched_engine_builds_no_snapshot(tiny_qwen2_path):
    engine = tiny_engine(tiny_qwen2_path, num_blocks=64)
    calls = {"snapshot": 0, "begin_step": 0}
    view = engine.core.view
    for name, target in (("snapshot", engine), ("begin_step", view)):
        original = getattr(target, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(target, name, counted)

    async def main():
        front = AsyncEngine(engine)
        front.start()
        async for _ in front.generate("quiet", random_prompt(9, 10), greedy(4)):
            pass
        unwatched = dict(calls)
        watcher = front.view_feed.subscribe(0.05)
        async for _ in front.generate("watched", random_prompt(9, 11), greedy(4)):
            pass
        first = await asyncio.wait_for(watcher.get(), 5)
        watcher.close()
        await asyncio.sleep(0.2)
        front.shutdown()
        return unwatched, first, front.view_feed.num_watchers

    unwatched, first, num_watchers = asyncio.run(asyncio.wait_for(main(), 30))
    assert unwatched == {"snapshot": 0, "begin_step": 0}
    assert calls["snapshot"] >= 1 and calls["begin_step"] >= 4
    assert first is not None and num_watchers == 0
    assert view.records is None  # the last watcher left: recording is off again


def test_slow_watcher_drops_snapshots_not_steps():
    from tinyserve.engine.view_feed import WATCHER_QUEUE, ViewFeed

    posted = []
    feed = ViewFeed(None, posted.append, lambda *a: None)
    slow = feed.subscribe(interval_s=0.0)
    sparse = feed.subscribe(interval_s=100.0)
    assert feed.num_watchers == 2 and feed.interval_s == 0.0 and len(posted) == 2
    for n in range(1, 11):  # nobody reads: the slow watcher's queue overflows
        feed._publish({"step": n, "steps": [{"step": n}]}, None)
    kept = [slow.queue.get_nowait() for _ in range(WATCHER_QUEUE)]
    assert [s["step"] for s in kept] == list(range(11 - WATCHER_QUEUE, 11))
    assert [r["step"] for s in kept for r in s["steps"]] == list(range(1, 11))
    # The 100 s watcher got the first snapshot only; the others' steps wait for its next one.
    assert sparse.queue.qsize() == 1 and sparse.queue.get_nowait()["step"] == 1
    feed._publish({"step": 11, "steps": [{"step": 11}]}, sparse)  # forced (its connect)
    assert [r["step"] for r in sparse.queue.get_nowait()["steps"]] == list(range(2, 12))
    slow.close()
    sparse.close()
    assert feed.num_watchers == 0 and posted[-1] == ("watch", None)


def test_the_idle_state_reaches_a_watcher_that_held_the_last_step_back():
    """The snapshot after a busy period's last step can fall inside a watcher's interval (its
    clock runs on the loop thread); the idle snapshot must still come, with that step."""
    from tinyserve.engine.view_feed import ViewFeed

    class Engine:  # the records since the last snapshot, as EngineView hands them over
        step, running, records = 0, 1, []

        def snapshot(self, take_steps):
            steps, self.records = (self.records, []) if take_steps else ([], self.records)
            return {"step": self.step, "running": self.running, "waiting": 0, "steps": steps}

    engine = Engine()
    feed = ViewFeed(engine, lambda cmd: None, lambda fn, *a: fn(*a))
    fast, sparse = feed.subscribe(interval_s=0.0), feed.subscribe(interval_s=100.0)
    for step, running in ((1, 1), (2, 0)):  # step 2 finishes the last request
        engine.step, engine.running = step, running
        engine.records.append({"step": step})
        feed.after_step()  # the engine's interval is the fast watcher's: builds every step
    feed.on_idle()
    feed.on_idle()  # once per busy period
    got = [sparse.queue.get_nowait() for _ in range(sparse.queue.qsize())]
    assert [s["step"] for s in got] == [1, 2] and got[-1]["running"] == 0
    assert [r["step"] for s in got for r in s["steps"]] == [1, 2]
    assert fast.queue.qsize() == 3 and feed.num_snapshots == 3
    fast.close()
    sparse.close()
