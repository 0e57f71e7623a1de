"""`WeightPuller`: the instance side of weight transfer. Pulls a version, serving it meanwhile.

    puller = WeightPuller(config, redis_client, run_id, instance_id, run_dir=run_dir)
    state_dict = puller.pull(version)      # blocks until the whole version is here and verified

`pull(version)` leases the version (store retention keeps it), checks the manifest from any source
against the sha256 the trainer recorded in Redis, downloads the chunks from every live holder,
complete or partial, rarest first (`infra.weights.chunk_choice`; `parallel_fetches` at a time, at
most `max_uploads_per_peer + 2` per holder), verifies each, drops a failing or slow source for
another or the store; with `serve_from_peers` it serves each chunk once verified. A copy failing
its check is logged at once and not asked for again (the store's after `STORE_RECHECK_S`); a part
no other source has fails the pull at once. It rebuilds a delta on the version it holds (else from
the whole version and the deltas after it: `full_fallbacks`). It returns the complete version or
raises `PullError`, withdrawing what it offered: it never loads part of a version nor serves an
unverified chunk. Versions only move forward; one pull at a time; `last_report`. Detail: §6.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Set
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch

from infra.weights.chunk_choice import plan
from infra.weights.config import WeightsConfig
from infra.weights.delta import DeltaError, reconstruct
from infra.weights.holders import HolderRegistry, chunk_bitmap, mark_chunk
from infra.weights.manifest import MANIFEST_FILE, EncodedVersion, Manifest, chunk_is_valid, decode, sha256_hex
from infra.weights.peer_client import PeerClient, SourceBusy, SourceFailed, SourceLacks
from infra.weights.peer_server import PROGRESS_HEADER, PULL_STARTED_HEADER, PeerServer
from infra.weights.retention import with_bases
from infra.weights.store import WeightStore

log = logging.getLogger(__name__)

STORE = "store"
"""Source name of the object store in a `PullReport`."""
STORE_RECHECK_S = 30.0
"""The store's copy of a part that failed its check is read again after this long (a restarted
trainer may be rewriting the version there); a peer's is never asked for again."""
_HOLDERS_REFRESH_S = 0.1
_RETRY_BACKOFF_S = 1.0


class AdapterBaseMismatch(ValueError):
    """A version made for another base model than the instance's (the message names both)."""


class PullError(RuntimeError):
    """A version could not be pulled completely; nothing of it was kept."""


@dataclass
class PullReport:
    version: int
    instance_id: str
    manifest_sha256: str = ""
    """sha256 of the version's manifest (the trainer's digest; every chunk was checked against it)."""
    seconds: float = 0.0
    """Wall time of the whole pull, decoding included (set when it succeeds)."""
    bytes: int = 0
    """Verified chunk bytes received."""
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    """Verified chunk bytes per source (a peer's base URL, or `STORE`)."""
    failures: list[str] = field(default_factory=list)
    """One line per failed attempt: source, what, why."""
    delta_bytes: int = 0
    """Of `bytes`, those of delta payloads."""
    full_fallbacks: int = 0
    """Times this pull rebuilt the version from a whole version instead of on the base it held:
    it held none (or not the delta's base), or the rebuilt weights' sha256 did not match."""
    source_fallbacks: int = 0
    """Payloads (the version, or a version of its chain) taken from other sources after a copy of
    their manifest or of a chunk failed its check, in this pull or an earlier try of it."""


class _CheckFailed(SourceFailed):
    """The source's bytes do not match the manifest (or the manifest its published sha256)."""


@dataclass
class _Rejections:
    """The copies of one payload (a version and its manifest's sha256) that failed their check:
    per part (None: the manifest, else a chunk index), the sources that delivered one and when."""

    instance_id: str
    version: int
    parts: dict[int | None, dict[str, float]] = field(default_factory=dict)

    def add(self, part: int | None, source: str, why: str) -> None:
        """Remember a copy that failed its check, and log it at once."""
        self.parts.setdefault(part, {})[source] = time.monotonic()
        log.warning(
            "instance %s: policy version %d: the %s from %s failed its check (%s); trying the other sources",
            self.instance_id,
            self.version,
            "manifest" if part is None else f"chunk {part}",
            source,
            why,
        )

    def excluded(self, part: int | None) -> set[str]:
        """The sources not to ask for `part` now: every peer whose copy failed, and the store
        until `STORE_RECHECK_S` after its copy failed."""
        now = time.monotonic()
        return {s for s, at in self.parts.get(part, {}).items() if s != STORE or now - at < STORE_RECHECK_S}

    def stranded(self, part: int | None, holders: Mapping[str, Set[int] | None]) -> bool:
        """Whether no source can supply `part` now: the store's copy failed its check (lately) and
        so did that of every holder that has it (`holders`: source -> its chunks, None: all)."""
        excluded = self.excluded(part)
        return STORE in excluded and all(
            source in excluded or (held is not None and part not in held) for source, held in holders.items()
        )


def _from_store(read: Callable[..., bytes], *args) -> bytes:
    """A store read; any error of the fsspec backend (they differ per backend) as `SourceFailed`."""
    try:
        return read(*args)
    except Exception as exc:
        raise SourceFailed(f"{type(exc).__name__}: {exc}") from exc


class WeightPuller:
    def __init__(
        self,
        config: WeightsConfig,
        redis_client: redis.Redis,
        run_id: str,
        instance_id: str,
        run_dir: str | Path | None = None,
        adapter_base: str | None = None,
    ) -> None:
        """`adapter_base`: this instance applies LoRA adapters to the base model with that digest
        (`rl.lora.base_digest`); a version made for another base (or of whole weights, or the
        reverse) is refused with `AdapterBaseMismatch` before any chunk is fetched."""
        self.config = config
        self.adapter_base = adapter_base
        self.instance_id = instance_id
        self.store = WeightStore(config.resolve_store_url(run_dir), config.store_options)
        self.peers = PeerClient(config.secret(), config, config.certificate()) if config.serves else None
        """None when nobody serves over HTTP (store only)."""
        self.server = PeerServer(config) if config.serve_from_peers else None
        self.registry = HolderRegistry(redis_client, run_id, config.holder_ttl_s)
        self._held: dict[int, EncodedVersion] = {}
        """Payloads (whole or delta) this instance serves."""
        self._base: tuple[int, dict[str, torch.Tensor]] | None = None
        """The newest pulled version's state dict: the base of the next delta."""
        self._fetchers = ThreadPoolExecutor(config.parallel_fetches, thread_name_prefix=f"pull-{instance_id}")
        self._pulling = threading.Lock()
        self._rejections: dict[tuple[int, str], _Rejections] = {}
        """Per payload (version, manifest sha256) not yet held, the copies that failed their check."""
        self.last_report: PullReport | None = None
        """The report of the latest pull (updated while it runs)."""

    @property
    def url(self) -> str | None:
        """Base URL of this instance's peer server (None when it does not serve)."""
        return self.server.url if self.server else None

    @property
    def held_versions(self) -> list[int]:
        return sorted(self._held)

    def pull(self, version: int) -> dict[str, torch.Tensor]:
        """The complete, verified state dict of `version` (see the module docstring). Its tensors are
        shared with the puller (the next delta's base): read them, never write them."""
        with self._pulling:
            if self._base is not None and self._base[0] == version:
                return dict(self._base[1])
            if self._held and version < max(self._held):
                raise ValueError(
                    f"versions only move forward: {self.instance_id} holds {max(self._held)}, asked for {version}"
                )
            report = PullReport(version=version, instance_id=self.instance_id)
            self.last_report = report
            started = time.monotonic()
            fetched: dict[int, EncodedVersion] = {}
            leased: list[int] = []
            try:
                try:
                    state = self._rebuild(version, report, fetched, leased, use_base=True)
                except DeltaError as exc:
                    report.full_fallbacks += 1
                    report.failures.append(f"v{version}: {exc}: rebuilding it from the whole version")
                    log.warning("weights v%d: %s: rebuilding it from the whole version", version, exc)
                    state = self._rebuild(version, report, fetched, leased, use_base=False)
            except BaseException as exc:
                for payload_version in fetched.keys() - self._held.keys():  # offered while pulled
                    self._withdraw_partial(payload_version)
                if isinstance(exc, DeltaError):
                    raise PullError(f"version {version} cannot be rebuilt: {exc}") from None
                raise
            finally:
                for leased_version in leased:
                    self.registry.unlease(leased_version, self.instance_id)
            report.manifest_sha256 = fetched[version].manifest_sha256 if version in fetched else ""
            report.source_fallbacks = len({v for (v, _), r in self._rejections.items() if r.parts and v in fetched})
            self._rejections = {key: r for key, r in self._rejections.items() if key[0] > version}
            for payload_version in sorted(fetched):
                self._hold(fetched[payload_version])
            self._base = (version, state)
            report.seconds = time.monotonic() - started
            return dict(state)

    def _rebuild(
        self,
        version: int,
        report: PullReport,
        fetched: dict[int, EncodedVersion],
        leased: list[int],
        use_base: bool,
    ) -> dict[str, torch.Tensor]:
        """`version`'s state dict from its payload and those down its chain of bases, to the held base
        (`use_base`) or a whole version; DeltaError when a rebuilt version's sha256 does not match."""
        chain: list[EncodedVersion] = []
        state = None
        current: int | None = version
        while current is not None:
            if use_base and self._base is not None and self._base[0] == current:
                state = self._base[1]
                break
            payload = self._held.get(current) or fetched.get(current) or self._fetch_payload(current, report, leased)
            fetched[current] = payload
            chain.append(payload)
            if payload.manifest.base is not None and payload.manifest.base >= current:
                raise DeltaError(f"version {current}: a delta's base must be older, got {payload.manifest.base}")
            current = payload.manifest.base
        if use_base and state is None and len(chain) > 1:  # lacked the base: whole version + deltas
            report.full_fallbacks += 1
        for payload in reversed(chain):
            manifest = payload.manifest
            decoded = decode(manifest, payload.chunks)
            if manifest.base is None:
                state = decoded
            else:
                state = reconstruct(state, decoded, manifest.full_sha256 or "", manifest.version)
        return state

    def _fetch_payload(self, version: int, report: PullReport, leased: list[int]) -> EncodedVersion:
        """Download one version's payload, leased (store retention keeps it) until the pull ends."""
        self.registry.lease(version, self.instance_id)
        leased.append(version)
        encoded = self._download(version, report)
        if encoded.manifest.base is not None:
            report.delta_bytes += encoded.manifest.total_bytes
        return encoded

    def _holders(self, version: int) -> list[str]:
        """Live holders of `version` other than this instance (none if HTTP is off)."""
        if self.peers is None:
            return []
        return [url for url in self.registry.holders(version) if url != self.url]

    def _download(self, version: int, report: PullReport) -> EncodedVersion:
        expected = self.registry.manifest_sha256(version)
        if expected is None:
            raise PullError(
                f"version {version} has no manifest digest in Redis: it was never published in run "
                f"{self.registry.run_id}, or it was garbage-collected"
            )
        deadline = time.monotonic() + self.config.pull_timeout_s
        report.manifest_sha256 = expected
        rejections = self._rejections.setdefault((version, expected), _Rejections(self.instance_id, version))
        manifest_bytes = self._manifest(version, expected, deadline, report, rejections)
        manifest = Manifest.from_bytes(manifest_bytes)
        self._check_base(manifest)
        download = _ChunkDownload(
            manifest,
            sources=lambda: self._sources(version),
            fetch=self._fetch_chunk,
            verified=self._serve_chunk,
            advertise=self._advertise,
            executor=self._fetchers,
            config=self.config,
            deadline=deadline,
            report=report,
            rejections=rejections,
        )
        if self.server is not None:
            self.server.offer_manifest(manifest, manifest_bytes)
        try:
            chunks = download.run()
        except BaseException:
            self._withdraw_partial(version)
            raise
        return EncodedVersion(manifest=manifest, manifest_bytes=manifest_bytes, chunks=chunks)

    def _check_base(self, manifest: Manifest) -> None:
        """`AdapterBaseMismatch` unless `manifest` holds what this instance applies: adapters of its
        own base model, or whole weights when it runs without adapters."""
        if manifest.adapter_base == self.adapter_base:
            return
        if self.adapter_base is None:
            raise AdapterBaseMismatch(
                f"policy version {manifest.version} holds LoRA adapters (of base {manifest.adapter_base[:12]}), but "
                "this instance runs without model.lora: start it with the run's engine settings (its --engine JSON)"
            )
        if manifest.adapter_base is None:
            raise AdapterBaseMismatch(
                f"policy version {manifest.version} holds whole weights, but this instance applies LoRA adapters: "
                "start it with the run's engine settings (its --engine JSON has no lora)"
            )
        raise AdapterBaseMismatch(
            f"policy version {manifest.version} holds LoRA adapters of base model {manifest.adapter_base[:12]}, "
            f"but this instance's base model (--model) is {self.adapter_base[:12]}: point --model at the run's "
            "model.path (the same weights the trainer loaded)"
        )

    def _sources(self, version: int) -> tuple[dict[str, frozenset[int] | None], Counter[int]]:
        """Live sources of `version` other than this instance: complete holders (None: every
        chunk) and partial holders (the chunks each serves); and how many partial holders are
        fetching each chunk."""
        if self.peers is None:
            return {}, Counter()
        sources: dict[str, frozenset[int] | None] = dict.fromkeys(self._holders(version))
        fetching: Counter[int] = Counter()
        for url, partial in self.registry.partial_holders(version).items():
            if url != self.url and url not in sources:
                sources[url] = partial.held
                fetching.update(partial.fetching)
        return sources, fetching

    def _serve_chunk(self, version: int, index: int, data: bytes) -> None:
        """Serve a chunk as soon as it is verified (before it is advertised)."""
        if self.server is not None:
            self.server.offer_chunk(version, index, data)

    def _advertise(self, version: int, held: bytes, fetching: bytes) -> None:
        """Advertise the chunks held (served already) and being fetched (bitmaps)."""
        if self.server is not None:
            self.registry.hold_chunks(version, self.server.url, held, fetching)

    def _withdraw_partial(self, version: int) -> None:
        """A failed pull: stop advertising and serving what it had verified."""
        if self.server is not None:
            self.registry.unhold_chunks(version, self.server.url)
            self.server.withdraw(version)

    def _manifest(
        self, version: int, expected_sha256: str, deadline: float, report: PullReport, rejections: _Rejections
    ) -> bytes:
        """The manifest's bytes from any holder or the store, checked against the published sha256;
        `PullError` at once when the copy of every source failed that check."""
        path = f"/weights/v{version}/{MANIFEST_FILE}"
        while True:
            holders = self._holders(version)
            if rejections.stranded(None, dict.fromkeys(holders)):
                raise PullError(
                    f"version {version}: the manifest of every source failed its check "
                    f"({', '.join(sorted(rejections.parts[None]))}) and no other source holds it"
                )
            if time.monotonic() >= deadline:
                raise PullError(
                    f"version {version}: no source delivered its manifest within {self.config.pull_timeout_s:.0f} s; "
                    f"last failures: {report.failures[-3:]}"
                )
            excluded = rejections.excluded(None)
            sources = [holder for holder in holders if holder not in excluded]
            random.shuffle(sources)
            rejected = False
            for source in [*sources, *([STORE] if STORE not in excluded else [])]:
                try:
                    if source == STORE:
                        data = _from_store(self.store.read_manifest_bytes, version)
                    else:
                        data = self.peers.get(source, path, {})
                except (SourceBusy, SourceFailed) as exc:
                    report.failures.append(f"{source}: manifest: {exc or 'busy'}")
                    continue
                if sha256_hex(data) == expected_sha256:
                    return data
                why = "sha256 does not match the published one"
                report.failures.append(f"{source}: manifest: {why}")
                rejections.add(None, source, why)
                rejected = True
            if not rejected:  # after a rejection, look again at once: maybe no source is left
                time.sleep(_RETRY_BACKOFF_S)

    def _fetch_chunk(self, manifest: Manifest, index: int, source: str, priority_headers: dict[str, str]) -> bytes:
        file = manifest.chunks[index].file
        if source == STORE:
            return _from_store(self.store.read_chunk, manifest.version, file)
        return self.peers.get(source, f"/weights/v{manifest.version}/{file}", priority_headers)

    def _hold(self, encoded: EncodedVersion) -> None:
        """Keep a complete payload; serve and advertise it; forget payloads beyond keep_in_memory (and
        the whole version and deltas those are rebuilt from)."""
        self._held[encoded.version] = encoded
        if self.server is not None:
            self.server.offer(encoded)
            self.registry.hold(encoded.version, self.server.url)
            self.registry.unhold_chunks(encoded.version, self.server.url)
        bases = {version: held.manifest.base for version, held in self._held.items()}
        kept = with_bases(sorted(self._held)[-self.config.keep_in_memory :], bases)
        for old in [version for version in sorted(self._held) if version not in kept]:
            if self.server is not None:
                self.registry.unhold(old, self.server.url)
                self.server.withdraw(old)
            del self._held[old]

    def close(self) -> None:
        """Leave the registry, stop serving, and release threads and connections."""
        self.registry.close()
        if self.server is not None:
            self.server.close()
        self._fetchers.shutdown(wait=True, cancel_futures=True)
        if self.peers is not None:
            self.peers.close()


class _ChunkDownload:
    """The chunk scheduler of one pull (steps 3 and 4 of the module docstring)."""

    def __init__(
        self,
        manifest: Manifest,
        *,
        sources: Callable[[], tuple[Mapping[str, Set[int] | None], Mapping[int, int]]],
        fetch: Callable[[Manifest, int, str, dict[str, str]], bytes],
        verified: Callable[[int, int, bytes], None],
        advertise: Callable[[int, bytes, bytes], None],
        executor: ThreadPoolExecutor,
        config: WeightsConfig,
        deadline: float,
        report: PullReport,
        rejections: _Rejections,
    ) -> None:
        """`rejections`: the copies of this payload that failed their check (this pull adds its own)."""
        self.manifest = manifest
        self.list_sources = sources
        self.fetch = fetch
        self.verified = verified
        self.advertise = advertise
        self.held = chunk_bitmap(len(manifest.chunks))
        self.fetching = chunk_bitmap(len(manifest.chunks))
        self.advertised = (bytes(self.held), bytes(self.fetching))
        self.executor = executor
        self.parallel = config.parallel_fetches
        self.per_holder_limit = config.max_uploads_per_peer + 2
        self.pull_timeout_s = config.pull_timeout_s
        self.deadline = deadline
        self.report = report
        self.rejections = rejections
        self.pull_started = time.time()
        self.progress = 0
        """Verified bytes so far (sent to holders, with `pull_started`, as this pull's priority)."""
        self.pending: set[int] = set(range(len(manifest.chunks)))
        self.results: dict[int, bytes] = {}
        self.failed_on: dict[int, set[str]] = {}
        """Sources that already failed to deliver a chunk, or did not hold it yet."""
        self.dropped: set[str] = set()
        """Holders that failed once: not asked again during this pull."""
        self.in_flight: dict[Future, tuple[int, str]] = {}
        self.per_source: Counter[str] = Counter()
        self.sources: Mapping[str, Set[int] | None] = {}
        self.fetched_elsewhere: Mapping[int, int] = {}
        self.store_retry_at = 0.0
        self.rng = random.Random()

    def run(self) -> tuple[bytes, ...]:
        total = len(self.manifest.chunks)
        next_refresh = 0.0
        try:
            while len(self.results) < total:
                now = time.monotonic()
                if now > self.deadline:
                    raise PullError(
                        f"version {self.manifest.version}: {len(self.results)} of {total} chunks after "
                        f"{self.pull_timeout_s:.0f} s; last failures: {self.report.failures[-3:]}"
                    )
                if now >= next_refresh:
                    self.sources, self.fetched_elsewhere = self.list_sources()
                    next_refresh = now + _HOLDERS_REFRESH_S
                self._raise_if_stranded()
                self._assign()
                state = (bytes(self.held), bytes(self.fetching))
                if state != self.advertised:
                    self.advertise(self.manifest.version, *state)
                    self.advertised = state
                if not self.in_flight:  # no source can be tried: give them all another chance
                    time.sleep(_RETRY_BACKOFF_S)
                    self.dropped.clear()
                    self.failed_on.clear()
                    self.store_retry_at = 0.0
                    continue
                done, _ = wait(self.in_flight, timeout=_HOLDERS_REFRESH_S, return_when=FIRST_COMPLETED)
                for future in done:
                    self._settle(future)
        finally:
            for future in self.in_flight:
                future.cancel()
        return tuple(self.results[i] for i in range(total))

    def _raise_if_stranded(self) -> None:
        """`PullError` when a chunk still wanted has no source left whose copy did not fail its check."""
        for chunk, failed in self.rejections.parts.items():
            if chunk is not None and chunk in self.pending and self.rejections.stranded(chunk, self.sources):
                raise PullError(
                    f"version {self.manifest.version}: chunk {chunk} of every source failed its check "
                    f"({', '.join(sorted(failed))}) and no other source holds it"
                )

    def _assign(self) -> None:
        """Request chunks, rarest first (`infra.weights.chunk_choice`), up to `parallel` at a time,
        sparing the seeds unless this puller would be idle; a chunk no usable holder has comes
        from the store."""
        if len(self.in_flight) >= self.parallel or not self.pending:
            return
        usable = {source: chunks for source, chunks in self.sources.items() if source not in self.dropped}
        excluded = {chunk: set(sources) for chunk, sources in self.failed_on.items()}
        store_rejected: set[int] = set()
        for chunk in self.rejections.parts:
            if chunk is not None:
                rejected = self.rejections.excluded(chunk)
                excluded[chunk] = excluded.get(chunk, set()) | rejected
                if STORE in rejected:
                    store_rejected.add(chunk)
        for spare_seeds in (True, False):
            for chunk, source in plan(
                self.pending,
                usable,
                self.fetched_elsewhere,
                self.per_source,
                self.per_holder_limit,
                excluded,
                self.rng,
                spare_seeds=spare_seeds,
            ):
                if len(self.in_flight) >= self.parallel:
                    return
                if source is None:
                    if time.monotonic() < self.store_retry_at or chunk in store_rejected:
                        continue
                    source = STORE
                self.pending.remove(chunk)
                mark_chunk(self.fetching, chunk)
                self.per_source[source] += 1
                headers = {PROGRESS_HEADER: str(self.progress), PULL_STARTED_HEADER: repr(self.pull_started)}
                future = self.executor.submit(self._fetch_verified, chunk, source, headers)
                self.in_flight[future] = (chunk, source)
            if self.in_flight:
                return

    def _fetch_verified(self, chunk: int, source: str, headers: dict[str, str]) -> bytes:
        """On a fetch thread: the chunk's bytes, checked against the manifest."""
        data = self.fetch(self.manifest, chunk, source, headers)
        if not chunk_is_valid(self.manifest.chunks[chunk], data):
            raise _CheckFailed("corrupt: size or sha256 does not match the manifest")
        return data

    def _settle(self, future: Future) -> None:
        chunk, source = self.in_flight.pop(future)
        self.per_source[source] -= 1
        mark_chunk(self.fetching, chunk, present=False)
        try:
            data = future.result()
        except SourceBusy:
            self.pending.add(chunk)
            return
        except SourceLacks:
            # advertised but not served (yet): ask elsewhere, and keep the source
            self.failed_on.setdefault(chunk, set()).add(source)
            self.pending.add(chunk)
            return
        except _CheckFailed as exc:
            self._failed(chunk, source, str(exc), check=True)
            return
        except SourceFailed as exc:
            self._failed(chunk, source, str(exc))
            return
        self.results[chunk] = data
        self.progress += len(data)
        self.report.bytes += len(data)
        self.report.bytes_by_source[source] = self.report.bytes_by_source.get(source, 0) + len(data)
        self.verified(self.manifest.version, chunk, data)
        mark_chunk(self.held, chunk)

    def _failed(self, chunk: int, source: str, why: str, check: bool = False) -> None:
        """`check`: the source's copy failed its check (remembered past this pull, logged at once)."""
        self.report.failures.append(f"{source}: chunk {chunk}: {why}")
        if check:
            self.rejections.add(chunk, source, why)
        else:
            log.warning("weights v%d: %s: chunk %d: %s", self.manifest.version, source, chunk, why)
        self.failed_on.setdefault(chunk, set()).add(source)
        if source == STORE:
            self.store_retry_at = time.monotonic() + _RETRY_BACKOFF_S
        else:
            self.dropped.add(source)
        self.pending.add(chunk)
