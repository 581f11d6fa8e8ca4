"""AsyncEngine over the FakeEngine: the inbox/thread/queue contract without HTTP."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.fake_engine import FakeEngine
from tinyserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from tinyserve.sampling_params import SamplingParams


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def _started(fake: FakeEngine, **kwargs) -> AsyncEngine:
    engine = AsyncEngine(fake, **kwargs)
    engine.start()
    return engine


def test_generate_streams_all_outputs_and_counts():
    async def main():
        engine = await _started(FakeEngine())
        outs = [o async for o in engine.generate("r1", [1, 2, 3], SamplingParams(max_tokens=5))]
        engine.shutdown()
        return outs

    outs = run(main())
    assert [o.new_token_ids[0] for o in outs] == [100, 101, 102, 103, 104]
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]


def test_n_samples_share_one_stream():
    async def main():
        engine = await _started(FakeEngine())
        outs = [o async for o in engine.generate("r", [1], SamplingParams(n=3, max_tokens=2))]
        engine.shutdown()
        return outs

    outs = run(main())
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
    assert len(outs) == 6


def test_several_prompts_are_one_request_with_one_stream():
    async def main():
        engine = await _started(FakeEngine())
        params = SamplingParams(n=2, max_tokens=2)
        outs = [o async for o in engine.generate("r", [[1, 2], [3, 4, 5]], params)]
        in_flight = engine.num_requests_in_flight
        engine.shutdown()
        return outs, in_flight

    outs, in_flight = run(main())
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2, 3]
    assert [o.request_finished for o in outs].count(True) == 1 and outs[-1].request_finished
    assert (outs[-1].usage.prompt_tokens, outs[-1].usage.completion_tokens) == (5, 8)
    assert in_flight == 0


def test_the_seams_are_typed():
    from tinyserve.engine.client import EngineClient, SyncEngine

    fake = FakeEngine()
    assert isinstance(fake, SyncEngine)
    assert isinstance(AsyncEngine(fake), EngineClient)
    assert not isinstance(object(), SyncEngine)


def test_validation_error_raises_before_streaming():
    async def main():
        fake = FakeEngine(max_model_len=64)
        engine = await _started(fake)
        with pytest.raises(ValueError, match="64"):
            await anext(engine.generate("r", [1] * 10, SamplingParams(max_tokens=100)))
        with pytest.raises(ValueError, match="prompt"):
            engine.add_request("r", [], SamplingParams())
        await asyncio.sleep(0.05)
        engine.shutdown()
        return fake

    fake = run(main())
    assert fake.num_steps == 0


def test_idle_engine_thread_sleeps():
    async def main():
        fake = FakeEngine()
        engine = await _started(fake)
        await asyncio.sleep(0.1)
        calls = fake.num_has_unfinished_calls
        t0 = time.thread_time()
        await asyncio.sleep(0.5)
        assert fake.num_has_unfinished_calls == calls  # no polling while idle
        assert time.thread_time() - t0 < 0.1
        async for _ in engine.generate("r", [1], SamplingParams(max_tokens=3)):
            pass
        await asyncio.sleep(0.1)
        calls = fake.num_has_unfinished_calls
        await asyncio.sleep(0.3)
        assert fake.num_has_unfinished_calls == calls
        engine.shutdown()

    run(main())


def test_cancelled_consumer_aborts_request():
    async def main():
        fake = FakeEngine(step_delay=0.01)
        engine = await _started(fake)

        async def consume():
            async for _ in engine.generate("r", [1], SamplingParams(max_tokens=400)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not fake.seqs:
                break
            await asyncio.sleep(0.01)
        engine.shutdown()
        return fake, engine

    fake, engine = run(main())
    assert fake.aborted == ["r"] and not fake.seqs
    assert engine.num_requests_in_flight == 0


def test_breaking_out_of_generate_aborts_request():
    async def main():
        fake = FakeEngine(step_delay=0.01)
        engine = await _started(fake)
        gen = engine.generate("r", [1], SamplingParams(max_tokens=400))
        async for _ in gen:
            break
        await gen.aclose()  # GeneratorExit in the generator
        for _ in range(100):
            if not fake.seqs:
                break
            await asyncio.sleep(0.01)
        engine.shutdown()
        return fake

    fake = run(main())
    assert fake.aborted == ["r"] and not fake.seqs


def test_queue_bound():
    async def main():
        fake = FakeEngine(max_num_seqs=2, step_delay=0.01)
        engine = await _started(fake, max_queued_requests=1)
        streams = [
            engine.add_request(f"r{i}", [1], SamplingParams(max_tokens=400)) for i in range(3)
        ]
        with pytest.raises(QueueFullError):
            engine.add_request("r4", [1], SamplingParams(max_tokens=4))
        with pytest.raises(QueueFullError):  # n counts as n sequences
            engine.add_request("r5", [1], SamplingParams(n=2, max_tokens=4))
        streams[0].abort()
        engine.add_request("r6", [1], SamplingParams(max_tokens=4))
        # Larger than running and waiting together: never admitted, so a ValueError (400)
        # naming the bound, not a QueueFullError (429) a client would retry forever.
        with pytest.raises(ValueError, match="at most 3 at once"):
            engine.add_request("r7", [[1]] * 2, SamplingParams(n=2, max_tokens=4))
        engine.shutdown()

    run(main())


def test_dead_engine_fails_pending_and_refuses_new():
    async def main():
        fake = FakeEngine(step_delay=0.01)
        engine = await _started(fake)
        stream = engine.add_request("r", [1], SamplingParams(max_tokens=400))
        await anext(stream)
        fake.explode = True
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            engine.add_request("r2", [1], SamplingParams(max_tokens=4))

    run(main())
