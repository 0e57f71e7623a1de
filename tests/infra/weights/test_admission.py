"""Upload slots (bounded; the least uploaded chunk, then the puller furthest behind, first) and the
emulated uplink cap."""

from __future__ import annotations

import asyncio
import time

from infra.weights.admission import UploadSlots, priority
from infra.weights.bandwidth import UploadCap


def test_a_freed_slot_goes_to_the_chunk_uploaded_least_then_to_the_puller_furthest_behind():
    async def scenario() -> list[str]:
        slots = UploadSlots(1)
        admitted: list[str] = []
        begun = {"a": 0, "b": 0, "c": 0}  # uploads begun per chunk, as the server counts them

        async def upload(name: str, chunk: str, progress: int, started: float) -> None:
            assert await slots.acquire(lambda: priority(begun[chunk], progress, started), timeout=5)
            begun[chunk] += 1
            admitted.append(name)
            assert slots.busy == 1
            await asyncio.sleep(0.01)
            slots.release()

        first = asyncio.create_task(upload("first", "a", 0, 0.0))
        await asyncio.sleep(0)  # first holds the only slot; the rest queue up
        waiting = [
            asyncio.create_task(upload(name, chunk, progress, started))
            for name, chunk, progress, started in [
                ("a-again", "a", 0, 0.5),
                ("b-ahead", "b", 900, 1.0),
                ("b-behind", "b", 100, 5.0),
                ("c-behind-later", "c", 100, 9.0),
            ]
        ]
        await asyncio.gather(first, *waiting)
        assert slots.busy == 0
        return admitted

    # ranked when each slot frees: b-ahead queued for a chunk nobody had been sent, but once
    # b-behind got that chunk it waits behind a-again (its chunk sent as often, its puller behind)
    assert asyncio.run(scenario()) == ["first", "b-behind", "c-behind-later", "a-again", "b-ahead"]


def test_a_request_waiting_too_long_is_refused_and_leaves_no_trace():
    async def scenario() -> None:
        slots = UploadSlots(1)
        assert await slots.acquire(lambda: priority(0, 0, 0.0), timeout=1)
        assert not await slots.acquire(lambda: priority(0, 0, 1.0), timeout=0.05)
        slots.release()
        assert slots.busy == 0
        assert await slots.acquire(lambda: priority(0, 0, 2.0), timeout=0.05)
        assert slots.busy == 1

    asyncio.run(scenario())


def test_a_cancelled_waiter_does_not_leak_its_slot():
    async def scenario() -> None:
        slots = UploadSlots(1)
        assert await slots.acquire(lambda: priority(0, 0, 0.0), timeout=1)
        waiter = asyncio.create_task(slots.acquire(lambda: priority(0, 0, 1.0), timeout=5))
        await asyncio.sleep(0.01)
        slots.release()  # hands the slot to the waiter ...
        waiter.cancel()  # ... which is cancelled before it runs: it either owns the slot or not
        try:
            owns_slot = await waiter
        except asyncio.CancelledError:
            owns_slot = False
        assert slots.busy == (1 if owns_slot else 0)
        if owns_slot:
            slots.release()
        assert await slots.acquire(lambda: priority(0, 0, 2.0), timeout=0.05)

    asyncio.run(scenario())


def test_upload_cap_limits_the_total_rate_of_concurrent_senders():
    async def scenario() -> float:
        cap = UploadCap(bytes_per_s=1_000_000)

        async def sender() -> None:
            for _ in range(10):
                await cap.take(20_000)

        start = time.monotonic()
        await asyncio.gather(sender(), sender(), sender())
        return time.monotonic() - start

    elapsed = asyncio.run(scenario())
    assert 0.58 <= elapsed < 1.5  # 600 kB at 1 MB/s, less the 20 ms late-wake-up credit
