"""A Redis with an append-only file keeps the token log across a crash: a real redis-server is
SIGKILLed (no shutdown, no save) after a flush, and a new server started on its directory holds the
logged tokens; without the append-only file nothing survives."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from infra.rollout.tokenlog import Flush, GroupSpec, TokenLog
from infra.services.redis_embedded import EmbeddedRedis


def _crash(server: EmbeddedRedis) -> None:
    os.kill(server.pid, signal.SIGKILL)
    server.stop()  # cleans up after the dead process


@pytest.mark.parametrize("appendfsync", ["everysec", None])
def test_a_redis_restarted_on_its_append_only_file_keeps_the_token_log(tmp_path, appendfsync):
    first = EmbeddedRedis(appendfsync=appendfsync, directory=tmp_path / "redis")
    first.start()
    client = redis.Redis.from_url(first.url)
    log = TokenLog(client, "aof")
    assert log.enqueue_step(1, 0, [GroupSpec(0, [1, 2, 3], n=2, max_new_tokens=8)])
    running, finished = log.claim(1, "worker-0", 0, 2)
    assert log.log(
        [
            Flush(running.sample_id, "worker-0", running.epoch, [5, 6], [-0.5, -0.25], offset=0),
            Flush(finished.sample_id, "worker-0", finished.epoch, [7], [-1.0], offset=0, finish_reason="stop"),
        ]
    ) == [True, True]
    client.close()
    time.sleep(1.5)  # everysec: what was written more than a second ago is on disk
    _crash(first)

    second = EmbeddedRedis(appendfsync=appendfsync, directory=tmp_path / "redis")
    with second:
        client = redis.Redis.from_url(second.url)
        if appendfsync is None:
            assert client.dbsize() == 0  # no persistence: the step is gone
        else:
            records = {r.sample_id: r for r in TokenLog(client, "aof").read_group(1, 0)}
            assert (records[running.sample_id].state, records[running.sample_id].token_ids) == ("running", [5, 6])
            assert records[running.sample_id].logprobs == pytest.approx([-0.5, -0.25])
            assert (records[finished.sample_id].state, records[finished.sample_id].token_ids) == ("done", [7])
        client.close()
