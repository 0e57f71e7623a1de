"""Where a rollout worker gets the policy versions it loads (docs/internals.md §6): `PulledWeights`
pulls an announced version from the peers that hold it, the trainer or the store, and reports the
transfer; `HandedOverWeights` takes the version the trainer handed over in the same process (a
co-located instance, `infra.rollout.direct_weights`). Which version to load, and when, is the
worker's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

import redis

from infra.rollout.direct_weights import DirectWeights
from infra.weights.holders import latest_version
from infra.weights.puller import PullError, WeightPuller
from infra.weights.shared import report_transfer, shared_config

log = logging.getLogger("rlboost.worker")

RETRY_S = 1.0
"""Wait after a failed pull before the next try (a source may have joined, or the version been
published again)."""


class WeightSource(Protocol):
    def newest(self) -> int | None:
        """The newest version there is to load (None before the first)."""
        ...

    def fetch(self, version: int) -> Mapping[str, Any] | None:
        """`version`'s state dict, or None when it cannot be had yet (asked again at the next poll)."""
        ...

    def loaded(self, version: int) -> None:
        """The engine loaded `version`'s state (just `fetch`ed)."""
        ...

    def close(self) -> None: ...


class _OnceAVersion:
    """Says that a version is awaited once per version, not at every poll."""

    def __init__(self) -> None:
        self._waiting_for: int | None = None

    def waiting(self, version: int, message: str, *args: Any) -> None:
        if self._waiting_for != version:
            log.info(message, *args)
            self._waiting_for = version


class PulledWeights(_OnceAVersion):
    """Versions pulled once announced, with the settings the trainer shared in Redis."""

    def __init__(self, client: redis.Redis, run_id: str, instance_id: str) -> None:
        super().__init__()
        self.client, self.run_id, self.instance_id = client, run_id, instance_id
        self.adapter_base: str | None = None
        """The digest of the base model this instance applies LoRA adapters to (None: whole weights);
        set once its engine is loaded, before the first pull."""
        self._puller: WeightPuller | None = None
        self._retry_at = 0.0
        self._failed: tuple[int, str] | None = None
        """The version whose pull failed last, and why (said once, not at every try)."""

    def newest(self) -> int | None:
        return latest_version(self.client, self.run_id)

    def fetch(self, version: int) -> Mapping[str, Any] | None:
        announced = latest_version(self.client, self.run_id)
        puller = self._puller or self._open_puller()
        if announced is None or announced < version or puller is None:
            self.waiting(version, "waiting for policy version %d to be announced (latest: %s)", version, announced)
            return None
        if time.monotonic() < self._retry_at:
            return None
        try:
            return puller.pull(version)
        except PullError as exc:
            self._retry_at = time.monotonic() + RETRY_S
            if self._failed != (version, str(exc)):
                log.warning("pulling policy version %d failed (%s); retrying every %.0f s", version, exc, RETRY_S)
                self._failed = (version, str(exc))
            return None

    def loaded(self, version: int) -> None:
        report = self._puller.last_report if self._puller is not None else None
        if report is not None:
            report_transfer(self.client, self.run_id, report)
            log.info(
                "loaded policy version %d (%s: %d bytes, %d of deltas; %d whole-version fallbacks) in %.2f s",
                version,
                "adapters" if self.adapter_base else "weights",
                report.bytes,
                report.delta_bytes,
                report.full_fallbacks,
                report.seconds,
            )
            if report.source_fallbacks:
                log.info(
                    "policy version %d: %d of its payloads came from other sources after a copy failed its check",
                    version,
                    report.source_fallbacks,
                )

    def close(self) -> None:
        if self._puller is not None:
            self._puller.close()

    def _open_puller(self) -> WeightPuller | None:
        """The weight puller, made from the settings the trainer shared (None before that)."""
        settings = shared_config(self.client, self.run_id)
        if settings is None:
            return None
        self._puller = WeightPuller(
            settings, self.client, self.run_id, self.instance_id, adapter_base=self.adapter_base
        )
        return self._puller


class HandedOverWeights(_OnceAVersion):
    """Versions the trainer hands over in this process: no pull, no transfer reported."""

    def __init__(self, direct: DirectWeights) -> None:
        super().__init__()
        self.direct = direct

    def newest(self) -> int | None:
        return self.direct.version

    def fetch(self, version: int) -> Mapping[str, Any] | None:
        state = self.direct.take(version)
        if state is None:
            self.waiting(version, "waiting for the trainer to hand over policy version %d", version)
        return state

    def loaded(self, version: int) -> None:
        log.info("loaded policy version %d from the trainer (in process)", version)

    def close(self) -> None:
        pass
