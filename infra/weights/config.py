"""`WeightsConfig`: the settings of pull-based weight transfer (docs/ARCHITECTURE.md §6), shared by the trainer
(`WeightPublisher`) and every rollout instance (`WeightPuller`).

Both sides read the secret from the same environment variable. The chunk layout travels in each
version's manifest, so a puller never needs the publisher's `chunk_mb`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field

from rl.config import Section

MIN_SECRET_CHARS = 16


class WeightsConfig(Section):
    """Pull-based weight transfer: object store, peer servers, retention."""

    store_url: str | None = None
    """fsspec URL of the run's weight store (versions live under `<store_url>/weights/v<v>/`):
    `file://`, `s3://`, `gs://` (`gcp` extra) or `az://` (`azure` extra). None: `<run dir>/store`."""
    store_options: dict[str, Any] = {}
    """fsspec storage options of the store (e.g. `client_kwargs: {endpoint_url: ...}` for S3)."""
    chunk_mb: float = Field(8.0, gt=0)
    """Target chunk size in MiB; tensors larger than a chunk are split across chunks."""
    keep_versions: int = Field(2, ge=1)
    """Newest complete versions kept in the store; older ones are deleted unless being pulled."""
    keep_in_memory: int = Field(2, ge=1)
    """Newest versions the trainer and each instance keep in memory and serve to peers."""
    serve_from_trainer: bool = True
    """The trainer serves each version from memory at once (the first seed). If False, `latest`
    is announced only once the version is in the store."""
    serve_from_peers: bool = True
    """Instances serve the versions they pulled to other instances."""
    secret_env: str = "RLBOOST_WEIGHTS_SECRET"
    """Name of the environment variable holding the shared secret of the peer endpoints (at least
    16 characters, the same on the trainer and every instance). Required when any side serves."""
    bind_host: str = "127.0.0.1"
    """Interface the peer servers listen on (`0.0.0.0` in a cluster)."""
    advertise_host: str | None = None
    """Host name or address peers use to reach this process; None: `bind_host`."""
    parallel_fetches: int = Field(16, ge=1)
    """Chunks one puller downloads at the same time, across all its sources."""
    max_uploads_per_peer: int = Field(2, ge=1)
    """Chunks a server (trainer or instance) uploads at the same time; further requests wait
    for a slot, the earliest puller first."""
    queue_timeout_s: float = Field(2.0, gt=0)
    """How long a request waits for an upload slot before the server answers 503 (busy)."""
    chunk_timeout_s: float = Field(30.0, gt=0)
    """A chunk whose body takes longer than this, or whose response does not start within
    `queue_timeout_s` + this, is abandoned and fetched from another source (the source is slow)."""
    pull_timeout_s: float = Field(600.0, gt=0)
    """A pull that has not completed after this long fails (nothing partial is kept)."""
    holder_ttl_s: float = Field(10.0, gt=0)
    """Lifetime of a holder or pull-lease entry in Redis; refreshed every third of it, so a dead
    peer stops being offered (and its lease stops protecting a version) after at most this."""
    max_clock_skew_s: float = Field(60.0, gt=0)
    """Largest accepted difference between a request's signed timestamp and the server's clock."""
    upload_cap_mb_s: float | None = Field(None, gt=0)
    """Cap on each server's total upload rate in MiB/s, to emulate a NIC on one machine
    (benchmarks); None: unlimited."""

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * 2**20))

    @property
    def serves(self) -> bool:
        """Whether any side serves over HTTP (and so needs the secret)."""
        return self.serve_from_trainer or self.serve_from_peers

    def resolve_store_url(self, run_dir: str | Path | None) -> str:
        """`store_url`, or `file://<run_dir>/store` when it is unset."""
        if self.store_url is not None:
            return self.store_url
        if run_dir is None:
            raise ValueError("weights.store_url is not set and no run directory was given to default it")
        return (Path(run_dir).resolve() / "store").as_uri()

    def secret(self) -> bytes:
        """The shared secret from the environment variable named by `secret_env`."""
        value = os.environ.get(self.secret_env, "")
        if len(value) < MIN_SECRET_CHARS:
            state = "is not set" if not value else f"has only {len(value)} characters"
            raise ValueError(
                f"weights: the peer endpoints need a shared secret, but the environment variable "
                f"{self.secret_env} (weights.secret_env) {state}; set it to the same random string of "
                f"at least {MIN_SECRET_CHARS} characters on the trainer and every instance, e.g. "
                f"`export {self.secret_env}=$(openssl rand -hex 32)`, or turn off "
                f"weights.serve_from_trainer and weights.serve_from_peers"
            )
        return value.encode()
