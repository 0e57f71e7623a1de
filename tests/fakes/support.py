"""Helpers for tests that drive providers against the fakes: a settable clock, and serving a fake
for the length of a test while failing it on any protocol violation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from tests.fakes.http import FakeServer

Fake = TypeVar("Fake", bound=FakeServer)


class Clock:
    """Epoch seconds that move only when a test says so."""

    def __init__(self, t: float = 1_750_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@contextmanager
def serving(fake: Fake) -> Iterator[Fake]:
    """Run `fake` on loopback; afterwards, fail if the client sent anything malformed."""
    with fake:
        yield fake
    assert not fake.violations, f"{type(fake).__name__} saw malformed requests: {fake.violations}"
