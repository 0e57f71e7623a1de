"""What a run does when its Redis stops answering (docs/internals.md §9).

The token log lives in Redis, so a Redis that goes away (killed, restarted, a network cut) stops
the step, but not at once: the fabric waits up to `fabric.redis_outage_timeout_s` for it to answer
a PING again (`wait_for_redis`) and then resumes the step where the token log says it is (a Redis
restarted on its append-only file keeps it). Past the timeout it raises `RedisUnreachable`; the
training session adds what the run kept (`RunStopped`: its last checkpoint) and the CLI prints it
as one line with the command that resumes the run. A weight publication that failed on the lost
Redis (`lost_redis`) goes to the run log when the fabric closes: it never replaces that line. The
Redis is named by `public_url`, never with its password.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import redis

REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
"""What redis-py raises when the server cannot be reached or does not answer."""


def lost_redis(error: BaseException) -> bool:
    """Whether `error` was raised from or during a Redis that could not be reached (`REDIS_ERRORS`
    in its chain): the `PublishError` of a version whose publication met a lost Redis, say."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, REDIS_ERRORS):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def public_url(url: str) -> str:
    """A Redis URL without its password (scheme, user, host, port, database)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    user = f"{parts.username}@" if parts.username else ""
    return f"{parts.scheme}://{user}{parts.hostname or 'localhost'}:{parts.port or 6379}{parts.path or '/0'}"


class RedisUnreachable(RuntimeError):
    """The run's Redis did not answer for the whole outage timeout."""

    def __init__(self, url: str, waited_s: float, cause: BaseException) -> None:
        self.url, self.waited_s = public_url(url), waited_s
        super().__init__(
            f"the token log's Redis at {self.url} has not answered for {waited_s:.0f} s (last error: {cause})"
        )


class RunStopped(RuntimeError):
    """The run stopped because its Redis is gone; the message says what was kept."""

    def __init__(self, unreachable: RedisUnreachable, checkpoint: Path | None, step: int | None) -> None:
        self.unreachable, self.checkpoint, self.step = unreachable, checkpoint, step
        kept = (
            f"kept: the checkpoint of step {step} ({checkpoint})"
            if checkpoint is not None
            else "kept: no checkpoint yet (a re-run starts from step 1)"
        )
        super().__init__(f"{unreachable}; {kept}")


def wait_for_redis(
    client: redis.Redis,
    url: str,
    timeout_s: float,
    cause: BaseException,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = 0.5,
) -> None:
    """Return as soon as Redis answers a PING; `RedisUnreachable` if it has not within `timeout_s`
    (`cause` is the error that started the wait)."""
    started = clock()
    while True:
        try:
            client.ping()
            return
        except REDIS_ERRORS as error:
            cause = error
        waited = clock() - started
        if waited >= timeout_s:
            raise RedisUnreachable(url, waited, cause) from None
        sleep(min(poll_s, timeout_s - waited))
