"""Upload slots (bounded, earliest puller first) and the emulated uplink cap."""

from __future__ import annotations

import asyncio
import time

from infra.weights.admission import UploadSlots, priority
from infra.weights.bandwidth import UploadCap


def test_slots_bound_concurrency_and_admit_the_earliest_puller_first():
    async def scenario() -> list[str]:
        slots = UploadSlots(1)
        admitted: list[str] = []

        async def upload(name: str, progress: int, started: float) -> None:
            assert await slots.acquire(priority(progress, started), timeout=5)
            admitted.append(name)
            assert slots.busy == 1
            await asyncio.sleep(0.01)
            slots.release()

        first = asyncio.create_task(upload("first", 0, 0.0))
        await asyncio.sleep(0)  # first holds the only slot; the rest queue up
        waiting = [
            asyncio.create_task(upload(name, progress, started))
            for name, progress, started in [
                ("late", 0, 9.0),
                ("middle", 500, 5.0),
                ("early", 0, 1.0),
                ("middle-ahead", 900, 5.0),
            ]
        ]
        await asyncio.gather(first, *waiting)
        assert slots.busy == 0
        return admitted

    assert asyncio.run(scenario()) == ["first", "early", "middle-ahead", "middle", "late"]


def test_a_request_waiting_too_long_is_refused_and_leaves_no_trace():
    async def scenario() -> None:
        slots = UploadSlots(1)
        assert await slots.acquire(priority(0, 0.0), timeout=1)
        assert not await slots.acquire(priority(0, 1.0), timeout=0.05)
        slots.release()
        assert slots.busy == 0
        assert await slots.acquire(priority(0, 2.0), timeout=0.05)
        assert slots.busy == 1

    asyncio.run(scenario())


def test_a_cancelled_waiter_does_not_leak_its_slot():
    async def scenario() -> None:
        slots = UploadSlots(1)
        assert await slots.acquire(priority(0, 0.0), timeout=1)
        waiter = asyncio.create_task(slots.acquire(priority(0, 1.0), timeout=5))
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
        assert await slots.acquire(priority(0, 2.0), timeout=0.05)

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
