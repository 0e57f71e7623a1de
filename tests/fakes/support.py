"""Serving a fake for the length of a test, failing it on any protocol violation (the settable
clock the fakes share is `tests.helpers.Clock`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from tests.fakes.http import FakeServer

Fake = TypeVar("Fake", bound=FakeServer)


@contextmanager
def serving(fake: Fake) -> Iterator[Fake]:
    """Run `fake` on loopback; afterwards, fail if the client sent anything malformed."""
    with fake:
        yield fake
    assert not fake.violations, f"{type(fake).__name__} saw malformed requests: {fake.violations}"
