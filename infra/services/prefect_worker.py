"""`python -m infra.services.prefect_worker --pool P [--work-queue Q] --name N`: a Prefect process worker
whose flow runs outlive its stop signal.

It is Prefect's process worker (`prefect.workers.process.ProcessWorker`), started differently from
`prefect worker start` in how it stops. The CLI's worker answers SIGTERM by stopping at once and
killing its flow runs' processes. Here those processes share the worker's process group (the work
pools' base job template), so a stop signal to the group (a preemption notice, `rlboost down`)
reaches them too, and they need a moment to end properly: a rollout instance drains and reports
Crashed, a training run stops its rollout instances and reports Crashed. So on SIGTERM or SIGINT
this worker takes no new flow run, waits until its runs' processes have exited, then exits; a
SIGKILL to the group ends it all at once. `--run-once` (a rollout instance): run the one flow run
waiting in the queue, exit when it ends. `--stop-with-parent`: when the process that started this
one dies (a training run killed without cleaning up), stop as if the group got SIGTERM, so no
instance outlives its controller (docs/internals.md §2, §9).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from prefect.workers.process import ProcessWorker


async def serve(
    pool: str, work_queues: list[str], name: str, limit: int, run_once: bool, stop_with_parent: bool
) -> None:
    from prefect.workers.process import ProcessWorker  # Prefect loads when the worker starts, not when it is named

    worker = ProcessWorker(
        work_pool_name=pool, work_queues=work_queues or None, name=name, limit=limit, create_pool_if_not_found=False
    )
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    serving = asyncio.ensure_future(worker.start(run_once=run_once))
    watchers = [asyncio.ensure_future(stopping.wait())]
    if stop_with_parent:
        watchers.append(asyncio.ensure_future(_parent_exits(os.getppid())))
    try:
        done, _ = await asyncio.wait({serving, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        if serving in done:
            serving.result()
            return
        if not stopping.is_set():  # orphaned: stop the whole instance as a notice would
            os.killpg(0, signal.SIGTERM)
        await _finish_running_flow_runs(worker, serving)
    finally:
        for watcher in watchers:
            watcher.cancel()


async def _parent_exits(parent: int, poll_s: float = 1.0) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(poll_s)


async def _finish_running_flow_runs(worker: ProcessWorker, serving: asyncio.Future) -> None:
    """Hold every free slot (no new flow run starts), wait for the running ones, stop serving."""
    held = []
    while True:
        try:
            borrower = object()
            worker.limiter.acquire_on_behalf_of_nowait(borrower)
            held.append(borrower)
        except anyio.WouldBlock:  # every slot is taken, by us or by running flow runs
            break
    while not serving.done() and worker.limiter.borrowed_tokens > len(held):
        await asyncio.sleep(0.1)
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m infra.services.prefect_worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pool", required=True, help="work pool to serve")
    parser.add_argument(
        "--work-queue", action="append", default=[], help="work queue to poll (repeatable; default: all)"
    )
    parser.add_argument("--name", required=True, help="worker name shown in the UI")
    parser.add_argument("--limit", type=int, default=4, help="most flow runs at once (default 4)")
    parser.add_argument(
        "--run-once", action="store_true", help="run the flow runs waiting now, then exit when they end"
    )
    parser.add_argument(
        "--stop-with-parent", action="store_true", help="stop when the process that started this one dies"
    )
    args = parser.parse_args(argv)
    asyncio.run(serve(args.pool, args.work_queue, args.name, args.limit, args.run_once, args.stop_with_parent))


if __name__ == "__main__":
    main()
