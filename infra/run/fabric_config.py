"""The `fabric` section of a run configuration: its pools, instances, worker settings, weights,
controller and cloud settings (torch-free; `infra.run.fabric.RolloutFabric` runs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from infra.pricing.egress import egress_usd_per_gb
from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.pool import PoolSpec
from infra.rollout.controller_config import ControllerConfig
from infra.rollout.settings import WorkerSettings
from infra.weights.config import WeightsConfig
from rl.config import Section

EGRESS_CLOUDS = ("gcp", "azure")
"""The clouds `fabric.capacity.egress_from` may name (those whose cloud pools the fleet runs)."""


class SweepSettings(Section):
    """The sweep of VMs whose run is not alive (`infra.run.sweep`), in the scopes of the run's cloud pools."""

    enabled: bool = True
    """Sweep when the run starts and every `interval_s` while it runs (`rlboost cloud sweep` runs it by hand)."""
    interval_s: float = Field(300.0, gt=0)
    """Seconds between the run's heartbeats in the ledger, and between its sweeps."""
    stale_after_s: float = Field(900.0, gt=0)
    """A run whose last heartbeat is older than this is not alive (its driver is gone): its VMs are
    deleted. More than twice `interval_s`, so that one late heartbeat is not a death."""
    delete_unknown: bool = False
    """Also delete labelled VMs whose run this ledger does not know, once older than `stale_after_s`
    (False: keep them; they may belong to a run that records into another ledger)."""

    @model_validator(mode="after")
    def _stale_after_two_beats(self) -> SweepSettings:
        if self.stale_after_s <= 2 * self.interval_s:
            raise ValueError(
                f"fabric.cloud.sweep.stale_after_s ({self.stale_after_s:g}) must exceed twice interval_s "
                f"({self.interval_s:g}): a live run beats every interval_s, and one late beat must not get its VMs deleted"
            )
        return self


class CloudSettings(Section):
    """How the cloud pools (`provider: gcp|azure`) of a run start and join it."""

    bootstrap: WorkerBootstrap = WorkerBootstrap()
    """How each VM installs the project and reaches Prefect (its boot script)."""
    model_url: str | None = None
    """fsspec URL the VMs read the base model from (a copy made with `infra.weights.model_source`); None:
    the run copies `model.path` to `<weights store>/base-model` when it starts."""
    reconcile_s: float = Field(30.0, gt=0)
    """Seconds between the capacity manager's reconciles (preemptions seen, replacements started)."""
    drain_timeout_s: float = Field(60.0, gt=0)
    """At the end of training, how long the VMs may take to finish their flow runs before they are deleted."""
    gcp_api_endpoint: str | None = None
    """Compute Engine API endpoint (e.g. a Private Service Connect address); None: Google's."""
    azure_base_url: str | None = None
    """Azure Resource Manager endpoint (e.g. a sovereign cloud's); None: the public one."""
    live_prices: bool = True
    """Quote the clouds' published prices (Cloud Billing Catalog, Azure Retail Prices); False: the
    bundled catalog only."""
    sweep: SweepSettings = SweepSettings()
    """Deleting the VMs of runs that are not alive (crashed drivers, ended runs), in the pools' scopes."""


class CapacitySettings(Section):
    """How the capacity manager sizes the cloud pools of a run; the local pools keep their `size`
    (docs/internals.md §3)."""

    policy: Literal["budget", "marginal"] = "marginal"
    """`marginal`: hold a cloud pool's k-th instance only while what it adds (the offload controller's
    step throughput per spot count, discounted by preemptions x `warmup_s`) per dollar, its price
    plus its weight pulls' egress, beats the run's tokens per dollar without it; instances no longer
    worth their price are drained, then deleted. `budget`: fill the cloud pools up to their size,
    cheapest per throughput first, within `budget_per_hour`. Neither sizes the local pools: they
    run their `size` (their spot ones as their `availability` allows)."""
    budget_per_hour: float | None = Field(None, gt=0)
    """Ceiling on the summed hourly price of the cloud pools' instances, under either policy (None: none)."""
    base_price_per_hour: float | None = Field(None, ge=0)
    """What the run pays per hour whatever its spot count (trainer, reserved machines), against
    which `marginal` weighs an instance; None: the non-spot pools' `price_per_hour` x `size`."""
    warmup_s: float = Field(240.0, gt=0)
    """Seconds from an instance's request to its first useful token (boot, install, weight pull):
    what each preemption wastes again."""
    drain_s: float = Field(60.0, gt=0)
    """How long an instance asked to drain (scaled down) may take before it is deleted."""
    egress_from: str | None = None
    """Where the instances pull the weights from (the trainer's machine, the weight store), as
    `gcp:<region>` or `azure:<location>`: `marginal` prices each cloud pool's pulled bytes at the
    bundled egress table's price from there to the pool's first zone (`infra/pricing/egress.py`: 0
    in one region). None: a machine outside the clouds, whose weights cost no cloud egress."""
    egress_usd_per_gb: float | None = Field(None, ge=0)
    """USD per GB of weights every cloud pool's instances pull, instead of the table's price."""

    @model_validator(mode="after")
    def _egress_from_names_a_cloud(self) -> CapacitySettings:
        cloud, _, region = (self.egress_from or "gcp:x").partition(":")
        if cloud not in EGRESS_CLOUDS or not region:
            raise ValueError(
                f"fabric.capacity.egress_from={self.egress_from!r} is not `gcp:<region>` or `azure:<location>` "
                "(e.g. gcp:us-central1): name where the trainer's machine runs, or remove it for a local one"
            )
        return self

    def base_price(self, pools: tuple[PoolSpec, ...]) -> float:
        """`base_price_per_hour`, or the non-spot pools' price per hour at their size."""
        if self.base_price_per_hour is not None:
            return self.base_price_per_hour
        return sum(pool.price_per_hour * pool.size for pool in pools if pool.capacity_class != "spot")

    def egress_prices(self, pools: tuple[PoolSpec, ...]) -> dict[str, float]:
        """USD per GB of weights pulled by each cloud pool's instances (local pools left out):
        `egress_usd_per_gb`, else the table's from `egress_from` to the pool's first zone, else 0."""
        prices = {}
        for pool in pools:
            if pool.provider == "local":
                continue
            if self.egress_usd_per_gb is not None:
                prices[pool.name] = self.egress_usd_per_gb
            elif self.egress_from is None:
                prices[pool.name] = 0.0
            else:
                cloud, _, region = self.egress_from.partition(":")
                prices[pool.name] = egress_usd_per_gb(cloud, region, pool.provider, pool.zones[0])
        return prices


class FabricConfig(Section):
    """Distributed rollout over a Redis token log and local instance pools."""

    enabled: bool = False
    """Roll out on worker instances (True) or in the training process (False)."""
    redis_url: str | None = None
    """Redis of the run; None uses `RLBOOST_REDIS_URL` from the environment (set by `rlboost up`'s
    workers) or else starts an embedded redis-server on a free loopback port."""
    redis_ca_file: Path | None = None
    """PEM file of the CA that signed the certificate of a rediss:// `redis_url` (None: the system's
    trust store). Every instance verifies the server with it: local ones read this file, cloud VMs
    get a copy written by their boot script."""
    allow_plaintext: bool = False
    """Let cloud pools (`provider: gcp|azure`) reach the run across networks without encryption: a
    redis:// `redis_url` and plain-HTTP weight peers. False (the default) refuses such a run; set
    True only where the network between the trainer and the VMs is private and trusted."""
    redis_appendfsync: Literal["always", "everysec", "no"] | None = None
    """Persistence of the embedded redis-server (no effect with a configured Redis): None keeps
    nothing; `everysec` (or `always`, `no`: when it fsyncs) keeps an append-only file under
    `<run>/redis/`, so a Redis restarted on it keeps the token log (a crash loses at most the last
    second of flushes with `everysec`)."""
    redis_outage_timeout_s: float = Field(30.0, gt=0)
    """How long a step waits for its Redis to answer again (a restart) before the run stops with
    one line naming the Redis, the last checkpoint and the command that resumes the run."""
    tokenlog_shards: int = Field(1, ge=1)
    """Hash tags the token log's keys spread over (`rlb:{R/k}:`, k < S; docs/internals.md §4): on a
    Redis Cluster `redis_url`, a few per master spread a run's samples over its nodes (sizing:
    docs/commands.md, "Redis Cluster"); 1 keeps every key under `rlb:{R}:`, one slot. A run
    resumes only with the count it started with."""
    pools: tuple[PoolSpec, ...] = ()
    """Instance pools: at least one; a `reserved` pool is the training cluster's share of rollout."""
    node_gpus: int | None = Field(None, ge=0)
    """GPUs of this machine (the trainer's node) that the local pools' `gpus_per_instance` are placed
    on, numbered as this process's `CUDA_VISIBLE_DEVICES` lists them (else 0, 1, ...); None: as many
    as torch counts here. A configuration that asks for more is refused before the run starts."""
    instances: Literal["process", "prefect"] = "process"
    """How local pools run an instance: `process` (a process group running `rlboost worker`) or
    `prefect` (a process group running a Prefect worker for its pool and a `rollout-instance/<pool>`
    flow run, shown in the Prefect UI; needs a Prefect server with prefect.yaml deployed: `rlboost up`)."""
    fork_instances: bool = True
    """With `instances: process`, fork each instance of a pool without GPUs from a template process
    that imported the worker and its engine once (a replacement registers in under a second instead
    of importing torch, transformers or vLLM again: `bench/instance_start.py`); False starts each as
    a new interpreter."""
    worker: WorkerSettings = WorkerSettings()
    """Rollout instance settings."""
    weights: WeightsConfig = WeightsConfig()
    """How instances get each policy version: object store, peer-to-peer pull, retention."""
    controller: ControllerConfig = ControllerConfig()
    """Reaping, stealing and adaptive offload."""
    cloud: CloudSettings = CloudSettings()
    """Cloud pools: VM boot script, base model copy, reconcile loop, API endpoints."""
    capacity: CapacitySettings = CapacitySettings()
    """How many instances the cloud pools hold: every one the budget allows, or those worth their
    price and egress (the local pools keep their `size`)."""
    ready_timeout_s: float = Field(180.0, gt=0)
    """How long to wait for the first instance to register before failing the step (a run with only
    cloud pools waits for a VM to boot and install the project: allow several minutes)."""
    max_instance_failures: int = Field(3, ge=1)
    """Failed instances in a row after which a pool gives up and the step fails with the last one's
    error. An instance failed when its worker exited by itself (or its VM runs on after its worker's
    flow run ended) or it did not register within `register_timeout_s`; each is replaced within the
    step (the step table's `replaced`), and an instance of the pool that registers resets the count."""
    register_timeout_s: float = Field(900.0, gt=0)
    """How long an instance may take from its launch to its worker's registration (engine loaded;
    on a cloud VM also boot and install) before it counts as failed and is replaced."""
    retain_steps: int = Field(16, ge=1)
    """Steps the token log keeps in Redis: a trained step older than the last `retain_steps` is
    deleted (its samples are in the run's step files). Must hold every step open at once
    (`training.max_staleness` + 1)."""
    stream_training: bool = True
    """Score each group and accumulate its gradient as soon as it completes, while the rest of
    the step is still generating (False: train once the whole step is collected)."""

    @model_validator(mode="after")
    def _ca_file_needs_tls(self) -> FabricConfig:
        if self.redis_ca_file is not None and self.redis_url is not None and not self.redis_url.startswith("rediss://"):
            raise ValueError(
                "fabric.redis_ca_file verifies a TLS server, but fabric.redis_url is not rediss://: "
                "use the server's rediss:// URL (its --tls-port), or remove fabric.redis_ca_file"
            )
        return self

    @property
    def cloud_pools(self) -> tuple[PoolSpec, ...]:
        """The pools of VMs on a cloud (`provider: gcp|azure`), which reach the run across networks."""
        return tuple(pool for pool in self.pools if pool.provider != "local")
