"""`wait_for_redis`: returns once a real Redis answers, raises `RedisUnreachable` naming it without
its password when it does not within the timeout (a manual clock). `lost_redis`: a failure caused
by a Redis that refused the connection."""

from __future__ import annotations

import pytest
import redis

from infra.run.redis_outage import RedisUnreachable, public_url, wait_for_redis
from infra.services.ports import free_port
from tests.helpers import Clock


def test_the_url_is_named_without_its_password():
    assert public_url("redis://:s3cret@10.0.0.5:6380/2") == "redis://10.0.0.5:6380/2"
    assert public_url("rediss://user:s3cret@cache.example.com") == "rediss://user@cache.example.com:6379/0"


def test_a_redis_that_answers_ends_the_wait(redis_client, redis_url):
    wait_for_redis(redis_client, redis_url, 5.0, ConnectionError("was down"))


def test_a_redis_that_stays_away_is_named_after_the_timeout():
    port = free_port()  # a port nothing listens on
    url = f"redis://:s3cret@127.0.0.1:{port}/0"
    clock = Clock(0.0)
    client = redis.Redis.from_url(url)
    with pytest.raises(RedisUnreachable) as raised:
        wait_for_redis(client, url, 3.0, ConnectionError("gone"), clock=clock, sleep=clock.advance)
    assert str(raised.value).startswith(f"the token log's Redis at redis://127.0.0.1:{port}/0 has not answered for 3 s")
    assert "s3cret" not in str(raised.value)


def test_a_publication_that_failed_on_an_unreachable_redis_is_a_lost_redis():
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from infra.run.redis_outage import lost_redis
    from infra.weights.publisher import PublishError

    with pytest.raises(redis.ConnectionError) as refused:
        redis.Redis(port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)).ping()  # nothing listens
    with pytest.raises(PublishError) as published:
        raise PublishError(f"weight publication failed: {refused.value}") from refused.value
    assert lost_redis(published.value)
    assert not lost_redis(PublishError("weight publication failed: the store refused the upload"))
