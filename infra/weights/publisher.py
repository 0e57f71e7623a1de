"""`WeightPublisher`: the trainer side of weight transfer. Publishes each version once.

    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    publisher.publish(version, model.state_dict())   # returns after a host copy (engines' dtype)
    publisher.close()                                # finishes pending work, stops serving

`publish` copies the tensors to host memory (the trainer may update them right after) for a thread
that encodes them, whole (the first, every `full_every`-th, any delta no smaller) or as a delta on
the version before (`infra.weights.delta`; it keeps that copy), records the manifest's sha256 in
Redis, hands the version's weights sha (`fingerprint` of the whole state) to `on_published` and, with `serve_from_trainer`, serves it from memory (`PeerServer`, the first seed: the
newest `keep_in_memory` and what they are rebuilt from), announces `latest` (only forward) and
queues it for the store. A second thread uploads the queue in order (a whole version drops what
waits before it) and applies retention; without `serve_from_trainer`, `latest` is announced once
stored. `publish` blocks only while two snapshots wait. A store failure is logged; anything that
makes a version unreachable is a `PublishError` from the next `publish` or `flush` on (§6).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import redis
import torch

from infra.weights.config import WeightsConfig
from infra.weights.delta import delta_layout_matches, encode_delta
from infra.weights.holders import HolderRegistry
from infra.weights.manifest import EncodedVersion, encode, fingerprint
from infra.weights.peer_server import PeerServer
from infra.weights.retention import versions_to_delete, with_bases
from infra.weights.store import WeightStore
from infra.weights.updates import UpdateMeter, WeightUpdates

log = logging.getLogger(__name__)


class PublishError(RuntimeError):
    """A published version could not be made available (the cause is chained)."""


class WeightPublisher:
    def __init__(
        self,
        config: WeightsConfig,
        redis_client: redis.Redis,
        run_id: str,
        run_dir: str | Path | None = None,
        dtype: torch.dtype | None = None,
        adapter_base: str | None = None,
        environ: Mapping[str, str] = os.environ,
        on_published: Callable[[int, str], None] | None = None,
    ) -> None:
        """`dtype`: floating-point tensors are published in it (the engines' dtype; None: as given).
        `adapter_base`: the versions are LoRA adapters of the base model with that digest
        (`rl.lora.base_digest`), recorded in every manifest so an instance can check its base.
        `environ` holds the peer secret (and certificate) the trainer's server uses.
        `on_published(version, weights_sha)`: called from the encoding thread once per version, before
        it is announced (the sha an instance that loaded it must report: `fingerprint`)."""
        self.config = config
        self.on_published = on_published
        self.dtype = dtype
        self.adapter_base = adapter_base
        self.store = WeightStore(config.resolve_store_url(run_dir), config.store_options)
        self.server = PeerServer(config, environ) if config.serve_from_trainer else None
        self.registry = HolderRegistry(redis_client, run_id, config.holder_ttl_s)
        self.last_upload_error: Exception | None = None
        self._snapshots: queue.Queue[tuple[int, int | None, dict[str, torch.Tensor]] | None] = queue.Queue(maxsize=2)
        self._served: dict[int, EncodedVersion] = {}
        self._state = threading.Condition()
        self._published: int | None = None
        self._upload_queue: list[EncodedVersion] = []
        """Encoded versions not yet stored, oldest first (from the newest whole version on)."""
        self._bases: dict[int, int | None] = {}
        """Each version's delta base (None: whole), as published or read from the store."""
        self._done_through = -1
        """Newest version whose whole pipeline (encode, serve, announce, store) has finished."""
        self._failure: BaseException | None = None
        self._meter = UpdateMeter()
        """Each encoded version's bytes and time: what an instance pulls per hour (`updates`)."""
        self._closed = False
        """close() was called: no more publish()."""
        self._closing = False
        """The encoder has stopped: the uploader finishes what it has, then stops."""
        self._encoder = threading.Thread(target=self._encode_loop, name=f"weights-encode-{run_id}", daemon=True)
        self._uploader = threading.Thread(target=self._upload_loop, name=f"weights-upload-{run_id}", daemon=True)
        self._encoder.start()
        self._uploader.start()

    @property
    def url(self) -> str | None:
        """Base URL of the trainer's peer server (None when it does not serve)."""
        return self.server.url if self.server else None

    def updates(self) -> WeightUpdates | None:
        """The recent versions' encoded bytes (deltas, or the first whole one) and pace (None before one)."""
        return self._meter.updates()

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Publish `version` (greater than every version published before); returns quickly."""
        self._raise_failure()
        with self._state:
            if self._closed:
                raise RuntimeError("publish() after close()")
            parent = self._published
        if parent is not None and version <= parent:
            raise ValueError(f"versions only move forward: published {parent}, then {version}")
        snapshot = {
            name: tensor.detach().to("cpu", dtype=self.dtype if tensor.is_floating_point() else None, copy=True)
            for name, tensor in state_dict.items()
        }
        with self._state:
            self._published = version
        self._snapshots.put((version, parent, snapshot))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every published version is encoded, served, announced and stored (or its
        upload failed or was superseded). TimeoutError after `timeout` seconds."""
        with self._state:
            done = self._state.wait_for(
                lambda: self._failure is not None or self._published is None or self._done_through >= self._published,
                timeout,
            )
        self._raise_failure()
        if not done:
            raise TimeoutError(f"weights v{self._published} not published within {timeout} s")

    def close(self) -> None:
        """Finish pending work, then stop serving and leave the registry. Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        try:
            self.flush()
        finally:
            self._snapshots.put(None)
            self._encoder.join()
            with self._state:
                self._closing = True
                self._state.notify_all()
            self._uploader.join()
            if self.server is not None:
                self.server.close()
            self.registry.close()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise PublishError(f"weight publication failed: {self._failure}") from self._failure

    def _fail(self, exc: BaseException) -> None:
        log.exception("weight publication failed")
        with self._state:
            self._failure = exc
            self._state.notify_all()

    def _encode_loop(self) -> None:
        previous: tuple[int, dict[str, torch.Tensor]] | None = None
        """The version encoded last and its snapshot: the next delta's base."""
        deltas = 0
        """Deltas encoded since the last whole version."""
        while (item := self._snapshots.get()) is not None:
            version, parent, snapshot = item
            del item
            try:
                encoded = None
                if (
                    previous is not None
                    and deltas + 1 < self.config.full_every
                    and delta_layout_matches(previous[1], snapshot)
                ):
                    encoded = encode_delta(
                        previous[1],
                        snapshot,
                        version,
                        previous[0],
                        self.config.chunk_bytes,
                        parent,
                        adapter_base=self.adapter_base,
                    )
                    deltas += 1
                    if encoded.manifest.total_bytes >= sum(t.numel() * t.element_size() for t in snapshot.values()):
                        encoded = None  # no smaller than the whole version: send that, and end the chain
                if encoded is None:
                    encoded = encode(
                        snapshot, version, self.config.chunk_bytes, parent=parent, adapter_base=self.adapter_base
                    )
                    deltas = 0
                previous = (version, snapshot) if self.config.full_every > 1 else None
                sha = encoded.manifest.full_sha256 or (fingerprint(snapshot) if self.on_published else None)
                del snapshot
                with self._state:
                    self._bases[version] = encoded.manifest.base
                self._meter.encoded(encoded.manifest.total_bytes)
                self.registry.record_manifest(version, encoded.manifest_sha256)
                if self.on_published is not None and sha is not None:
                    self.on_published(version, sha)
                if self.server is not None:
                    self._serve(encoded)
                    self.registry.announce(version)
            except Exception as exc:
                previous = None  # the next version is whole: no receiver has a base for it
                self._fail(exc)
                continue
            with self._state:
                if encoded.manifest.base is None:  # nothing before a whole version is needed any more
                    self._upload_queue.clear()
                self._upload_queue.append(encoded)
                self._state.notify_all()

    def _serve(self, encoded: EncodedVersion) -> None:
        self.server.offer(encoded)
        self.registry.hold(encoded.version, self.server.url)
        with self._state:
            self._served[encoded.version] = encoded
            kept = with_bases(sorted(self._served)[-self.config.keep_in_memory :], self._bases)
            evicted = [old for old in self._served if old not in kept]
            for old in evicted:
                del self._served[old]
        for old in evicted:
            self.registry.unhold(old, self.server.url)
            self.server.withdraw(old)

    def _upload_loop(self) -> None:
        while True:
            with self._state:
                self._state.wait_for(lambda: self._upload_queue or self._closing)
                if not self._upload_queue:
                    return
                encoded = self._upload_queue.pop(0)
            try:
                self.store.write(encoded)
                if self.server is None:
                    self.registry.announce(encoded.version)
            except Exception as exc:
                self.last_upload_error = exc
                if self.server is None:
                    self._fail(exc)
                else:
                    log.warning(
                        "weights v%d: upload to %s failed (the trainer serves it): %s",
                        encoded.version,
                        self.store.url,
                        exc,
                    )
            else:
                self._collect_garbage()
            with self._state:
                self._done_through = max(self._done_through, encoded.version)
                self._state.notify_all()

    def _collect_garbage(self) -> None:
        """Apply retention to the store; a failure is only logged (the next upload tries again)."""
        try:
            self._delete_expired_versions()
        except Exception as exc:
            log.warning("weights: store retention failed, will retry after the next upload: %s", exc)

    def _delete_expired_versions(self) -> None:
        leased = self.registry.leased_versions()
        stored = self.store.versions()
        with self._state:
            bases = dict(self._bases)
        for version in (v for v, complete in stored.items() if complete and v not in bases):  # an earlier driver's
            bases[version] = self.store.read_manifest(version).base
        deleted = versions_to_delete(stored, leased, self.config.keep_versions, bases)
        for version in deleted:
            self.store.delete(version)
        with self._state:
            served = set(self._served)
            newest_stored = max(stored, default=-1)
            self._bases = {
                v: base
                for v, base in (bases | self._bases).items()
                if v in served or v > newest_stored or (v in stored and v not in deleted)
            }
        kept = set(self.store.complete_versions()) | served | leased
        newest_kept = max(kept, default=-1)
        self.registry.forget_manifests(
            v for v in self.registry.recorded_versions() if v not in kept and v < newest_kept
        )
