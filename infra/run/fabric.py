"""The rollout fabric of one run (docs/internals.md §3-5): Redis, the instance pools running rollout
workers, weight publication, and the controller that rolls out each step over the token log.

`RolloutFabric` is what the training session uses instead of its in-process engine when
`fabric.enabled` is set. It starts an embedded Redis unless a URL is configured, starts a
`colocated` reserved pool's instance in this process (`infra.run.colocated`: weights in memory),
launches the other local pools (spot ones preempted by trace or Poisson schedules), keeps its cloud
pools (`provider: gcp|azure`) at target through a `CloudFleet`, `publish`es each policy version for
the workers, and `rollout` returns every step's samples as `rl.rollout.Sample`s, as in process.

A cloud VM is a Prefect worker running one `rollout-instance/<pool>` flow run created before it
(`infra.fleet.instance_runs`); secrets reach it through a Prefect Secret block, the base model as a
copy under the weight store (`infra.weights.model_source`). So cloud pools need a Prefect server
(`rlboost up`, or `cloud.bootstrap.prefect_api_url`), a Redis (`fabric.redis_url`) and a weight
store (`weights.store_url`) that the VMs reach (docs/cloud-pools.md).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from infra.fleet.cloud_fleet import CloudFleet, check_reachable_by_vms
from infra.fleet.instance_watch import InstanceWatch, WorkerEnd
from infra.providers.composite import CompositeProvider
from infra.providers.interface import InstanceRecord, Provider
from infra.providers.local import LocalProvider
from infra.providers.placement import plan_node
from infra.providers.pool import PoolSpec
from infra.providers.warm_start import WarmStart
from infra.rollout.control import Drain
from infra.rollout.controller import AdmittedStep, RolloutController, StepReport, TakeOver, samples_of_group
from infra.rollout.instance import InstanceSpec
from infra.rollout.protocol import current_window
from infra.rollout.registry import InstanceRegistry
from infra.rollout.settings import worker_flags
from infra.rollout.tokenlog import EnvironmentSpec, GroupSpec, TokenLog
from infra.rollout.worker_config import instance_flags
from infra.rollout.worker_engine import HF_WORKER_MODULES, VLLM_WORKER_MODULES
from infra.run.colocated import ColocatedInstance, WithColocated
from infra.run.fabric_config import CloudSettings, FabricConfig
from infra.run.fleet_events import FleetEvents
from infra.run.redis_address import remove_redis_url, write_redis_url
from infra.run.redis_outage import REDIS_ERRORS, lost_redis, public_url, wait_for_redis
from infra.run.user_code import python_path
from infra.services.redis_embedded import REDIS_CA_FILE_ENV, REDIS_URL_ENV, EmbeddedRedis, RedisSettings
from infra.weights.config import WeightsConfig
from infra.weights.model_source import upload_model
from infra.weights.publisher import PublishError, WeightPublisher
from infra.weights.puller import STORE
from infra.weights.shared import Transfer, drain_transfers, share_config
from infra.weights.tls import CERT_ENV as TLS_CERT_ENV
from infra.weights.tls import PeerCertificate
from rl.config import PromptConfig, RolloutConfig
from rl.datasets import PromptRecord
from rl.devices import TORCH_DTYPES
from rl.engine_spec import EngineSpec
from rl.lora import base_digest
from rl.prompts import encode_prompt
from rl.rollout import Sample, step_seed

if TYPE_CHECKING:
    from infra.fleet.instance_runs import InstanceRuns
    from infra.fleet.prefect_local import PrefectLocalProvider

log = logging.getLogger(__name__)


def environment_block_name(run_id: str) -> str:
    """The Prefect Secret block holding a run's instance environment (lowercase letters, digits, dashes)."""
    return "rlboost-" + re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-") + "-instances"


def cloud_options(cloud: CloudSettings) -> dict[str, dict[str, Any]]:
    """Keyword arguments of each cloud's provider from the settings (credentials stay the SDKs' defaults)."""
    gcp: dict[str, Any] = {"live_prices": cloud.live_prices}
    if cloud.gcp_api_endpoint is not None:
        from google.api_core.client_options import ClientOptions

        gcp["client_options"] = ClientOptions(api_endpoint=cloud.gcp_api_endpoint)
    azure: dict[str, Any] = {"live_prices": cloud.live_prices}
    if cloud.azure_base_url is not None:
        azure["base_url"] = cloud.azure_base_url
    return {"gcp": gcp, "azure": azure}


def peer_weights_config(config: FabricConfig) -> WeightsConfig:
    """`fabric.weights`, with HTTPS between peers whenever a cloud pool's VMs take part (they
    reach the trainer and each other across networks) unless `fabric.allow_plaintext`."""
    if config.cloud_pools and not config.allow_plaintext and not config.weights.tls:
        return config.weights.model_copy(update={"tls": True})
    return config.weights


def peer_environment(weights: WeightsConfig) -> dict[str, str]:
    """The variables that give an instance the run's weights secret and, with `weights.tls`, its
    peer certificate: the user's own where this process's environment sets them (remote instances
    need them too), else fresh ones for this run (none when nothing serves weights)."""
    if not weights.serves:
        return {}
    environment = {weights.secret_env: os.environ.get(weights.secret_env) or secrets.token_hex(32)}
    if weights.tls:
        user_set = TLS_CERT_ENV in os.environ
        environment.update(
            (PeerCertificate.from_environment() if user_set else PeerCertificate.generate()).environment()
        )
    return environment


class RolloutFabric:
    def __init__(
        self,
        config: FabricConfig,
        run_id: str,
        run_dir: Path,
        model_path: Path,
        engine: EngineSpec,
        trainer_device: str,
        instance_prefix: str = "",
        take_over_step: int | None = None,
        user_code: Mapping[str, Path] | None = None,
        run_name: str | None = None,
    ) -> None:
        """`engine` is the run's engine (each pool's overrides apply); weights travel in its dtype.
        `user_code` (top-level module -> its source, `infra.run.user_code`) reaches every instance:
        local ones on `PYTHONPATH`, cloud VMs in the run's code bundle.
        `trainer_device` is where a colocated pool's engine runs when its device is `auto`.
        A re-run of a crashed run gives its attempt's `instance_prefix` (`infra.run.identity`) and
        the step it resumes, `take_over_step`: the controller takes the run's Redis state over
        (`RolloutController.take_over`, in `self.take_over`) before any instance starts.
        `run_name` (`run.name`; default: `run_id`) names the run in its Prefect events."""
        if not config.pools:
            raise ValueError("fabric.pools is empty: configure at least one pool of rollout instances")
        self.config = config
        self.placement = plan_node(config.pools, config.node_gpus, torch.cuda.device_count)
        """The GPU slots of each local pool with `gpus_per_instance` (`infra.providers.placement`)."""
        self.run_id = run_id
        self.model_path = Path(model_path)
        self.run_dir = Path(run_dir)
        self.engine = engine
        self.instance_prefix = instance_prefix
        self.user_code = dict(user_code or {})
        self.events = FleetEvents(run_name or run_id, run_id)
        """The run's Prefect events: preemptions, replacements, published versions."""
        self._redis_server: EmbeddedRedis | None = None
        with ExitStack() as stack:  # what is made is closed again, in reverse, if a later part fails
            self._open(stack, config, run_id, run_dir, trainer_device, take_over_step)
            self._resources = stack.pop_all()
            """What `close` undoes, last made first (the fleet, the local instances, the colocated
            ones, the publisher, Redis)."""

    def _open(
        self,
        stack: ExitStack,
        config: FabricConfig,
        run_id: str,
        run_dir: Path,
        trainer_device: str,
        take_over_step: int | None,
    ) -> None:
        """Start Redis, the token log, controller and publisher, the instances and the fleet; each
        part's undoing goes on `stack` as soon as the part exists."""
        configured_redis = config.redis_url or os.environ.get(REDIS_URL_ENV)
        if configured_redis is None:
            persistent = config.redis_appendfsync is not None
            self._redis_server = EmbeddedRedis(
                appendfsync=config.redis_appendfsync, directory=self.run_dir / "redis" if persistent else None
            )
            self._redis_server.start()
            stack.callback(self._redis_server.stop)
            write_redis_url(self.run_dir, self._redis_server.url)  # for `rlboost status --run NAME`
            stack.callback(remove_redis_url, self.run_dir)
        self.redis_url = self._redis_server.url if self._redis_server else configured_redis
        self.redis_ca_file = None if config.redis_ca_file is None else config.redis_ca_file.resolve()
        """The CA of a rediss:// Redis, which every instance verifies the server with."""
        field = "fabric.redis_url" if config.redis_url or self._redis_server else f"${REDIS_URL_ENV}"
        self.redis = RedisSettings(url=self.redis_url, ca_file=self.redis_ca_file).client(field)
        stack.callback(self.redis.close)
        self.log = TokenLog(self.redis, run_id, shards=config.tokenlog_shards)
        self.registry = InstanceRegistry(self.redis, run_id)
        self.controller = RolloutController(self.redis, run_id, config.controller, clock=time.time)
        self.colocated: list[ColocatedInstance] = []
        self.take_over: TakeOver | None = None
        """What the dead driver left of the resumed step (None for a run's first driver)."""
        if take_over_step is not None:
            self.take_over = self.controller.take_over(take_over_step)
        weights = self.weights_config = peer_weights_config(config)
        self.peer_environment = peer_environment(weights)
        """The weights secret (and peer certificate) of the run, handed to every instance through
        its environment argument; this process's own environment is never written."""
        share_config(self.redis, run_id, weights, run_dir)
        self.weights = WeightPublisher(
            weights,
            self.redis,
            run_id,
            run_dir=run_dir,
            dtype=TORCH_DTYPES[self.engine.dtype],
            adapter_base=None if self.engine.lora is None else base_digest(self.model_path),
            environ=self.peer_environment,
            on_published=self._version_published,
        )
        stack.callback(self._close_weights)
        self._step = 0
        self._open_instances(stack, config, run_dir, trainer_device)

    def _open_instances(self, stack: ExitStack, config: FabricConfig, run_dir: Path, trainer_device: str) -> None:
        """The colocated instances, the local pools' provider, the cloud fleet, the instance watch;
        then start them all."""
        for index, pool in enumerate(config.pools):
            if pool.colocated:
                instance = self._colocated_instance(index, pool, trainer_device)
                self.colocated.append(instance)
                stack.callback(instance.close)  # it hands its samples back through Redis: closed before it
        local_pools = [pool for pool in config.pools if pool.provider == "local" and not pool.colocated]
        cloud_pools = [pool for pool in config.pools if pool.provider != "local"]
        providers: dict[str, Provider] = {}
        self._local_provider: LocalProvider | PrefectLocalProvider | None = None
        if local_pools:
            providers["local"] = self._local_provider = self._select_provider(run_dir / "instances")
        self.fleet: CloudFleet | None = None
        self.instance_runs: InstanceRuns | None = None
        if cloud_pools:
            self.fleet = self._cloud_fleet()
            providers.update(self.fleet.providers)
        self.provider = WithColocated(CompositeProvider(providers), self.colocated)
        """The instances of the run: the providers' and the colocated ones (the ledger reads them)."""
        stack.callback(self.provider.shutdown)
        self.watch = self._instance_watch([*local_pools, *cloud_pools])
        for instance in self.colocated:
            instance.start()
        for pool in local_pools:
            self.provider.launch(pool, pool.size)
        self.provider.start()
        if self.fleet is not None:
            stack.callback(self._stop_fleet)
            self.fleet.start()

    def _instance_watch(self, pools: list[PoolSpec]) -> InstanceWatch:
        """The watch that replaces the failed instances of `pools` (`infra.fleet.instance_watch`)."""
        config = self.config
        settle_s = max((pool.notice_s for pool in pools), default=0.0) + 2 * config.cloud.reconcile_s
        return InstanceWatch(
            self.provider,
            pools,
            registered=lambda: {s.spec.instance_id: s.policy_version for s in self.registry.all()},
            max_failures=config.max_instance_failures,
            register_timeout_s=config.register_timeout_s,
            settle_s=settle_s,
            worker_ends=self._worker_ends,
            explain=self._explain_exit,
            accepted=self._oldest_accepted,
            stall_s=self.weights_config.stall_s,
        )

    def _oldest_accepted(self) -> int | None:
        """The oldest policy version an instance can claim the open steps with (None: none open)."""
        window = current_window(self.redis, self.run_id)
        return None if window is None else max(0, window.version - window.staleness)

    def _instance_runs(self) -> list[InstanceRuns]:
        """The flow runs of the instances that run as Prefect flow runs (cloud VMs, local ones)."""
        local = self._local_provider
        return [
            *([self.instance_runs] if self.instance_runs is not None else []),
            *([local.runs] if local is not None and not isinstance(local, LocalProvider) else []),
        ]

    def _worker_ends(self, live: Collection[str]) -> dict[str, WorkerEnd]:
        return {i: end for runs in self._instance_runs() for i, end in runs.worker_ends(live).items()}

    def _explain_exit(self, instance_id: str) -> str:
        """Why an instance exited, on one line: its flow run's message, else its log's last line."""
        for runs in self._instance_runs():
            message = runs.run_message(instance_id)
            if message:
                return message
        local = self._local_provider
        return local.last_log_line(instance_id) if local is not None else ""

    def _colocated_instance(self, index: int, pool: PoolSpec, trainer_device: str) -> ColocatedInstance:
        return ColocatedInstance(
            pool,
            self.engine,
            trainer_device,
            redis_url=self.redis_url,
            redis_ca_file=self.redis_ca_file,
            run_id=self.run_id,
            model_path=self.model_path,
            worker=self.config.worker,
            field=f"fabric.pools[{index}] ({pool.name}, colocated)",
            instance_prefix=self.instance_prefix,
        )

    def _cloud_fleet(self) -> CloudFleet:
        """The fleet of the cloud pools, with a flow run per VM and the secrets the VMs read."""
        from infra.fleet.cloud_boot import CloudBoot
        from infra.fleet.instance_runs import InstanceRuns, InstanceRunSpec
        from infra.services.prefect_api import check_api, current_api_url

        cloud = self.config.cloud
        check_reachable_by_vms(self.redis_url, self.config.pools)
        api_url = check_api(cloud.bootstrap.prefect_api_url or current_api_url(), purpose="cloud pools")
        weights = self.weights_config
        store = weights.resolve_store_url(self.run_dir).rstrip("/")
        model = cloud.model_url or upload_model(self.model_path, f"{store}/base-model", weights.store_options)
        spec = InstanceRunSpec(
            run_id=self.run_id,
            redis_url=self.redis_url,
            model=model,
            worker=self.config.worker,
            engine=self.engine,
            environment_block=environment_block_name(self.run_id),
            redis_ca_file=self._ca_path(),
        )
        self.instance_runs = runs = InstanceRuns(spec, api_url)
        bootstrap = cloud.bootstrap
        if bootstrap.prefect_api_url is None:
            bootstrap = bootstrap.model_copy(update={"prefect_api_url": api_url})
        if self.redis_ca_file is not None and bootstrap.redis_ca_pem is None:
            bootstrap = bootstrap.model_copy(update={"redis_ca_pem": self.redis_ca_file.read_text()})
        boot = CloudBoot(runs, self.engine)
        cloud_pools = [pool for pool in self.config.pools if pool.provider != "local"]
        # The run's code before its secrets: a run that cannot ship its wheel leaves no Secret block.
        boot.ship(cloud_pools, bootstrap, store, weights.store_options, self.run_dir / "code", self.user_code)
        runs.publish_environment({REDIS_URL_ENV: self.redis_url, **self.peer_environment})
        return CloudFleet(
            self.config.pools,
            run_id=self.run_id,
            redis_url=self.redis_url,
            bootstrap=bootstrap,
            on_change=self._cloud_instance_changed,
            boot_hooks=boot,
            current_step=lambda: self._step,
            interval_s=cloud.reconcile_s,
            options=cloud_options(cloud),
            capacity=self._capacity_options(),
        )

    def _capacity_options(self) -> dict[str, Any]:
        """The `CapacityManager`'s settings from `fabric.capacity`: the controller's throughput
        curve, each cloud pool's egress price and the publisher's measured bytes and pace of the
        versions (what an instance's pulls cost), and a registry `drain` message for an instance
        scaled down. A run whose rollout has no local pool makes nothing without the cloud's
        instances: its curve starts at 0 tokens for 0 instances (otherwise the marginal policy
        would wait for a step that never runs)."""
        capacity = self.config.capacity
        alone = any(pool.provider == "local" for pool in self.config.pools)

        def curve() -> dict[int, float]:
            measured = self.controller.offload.throughput_curve()
            return measured if alone else {0: 0.0, **measured}

        return {
            "policy": capacity.policy,
            "budget_per_hour": capacity.budget_per_hour,
            "warmup_s": capacity.warmup_s,
            "throughput_curve": curve,
            "base_price_per_hour": capacity.base_price(self.config.pools),
            "drain": self._drain,
            "drain_s": capacity.drain_s,
            "egress_usd_per_gb": capacity.egress_prices(self.config.pools),
            "weight_updates": self.weights.updates,
        }

    def _drain(self, instance_id: str) -> bool:
        """Ask an instance to finish its work (a scale-down): its end is then no failure."""
        self.watch.expect_end(instance_id)
        return self.registry.request(instance_id, Drain())

    def _cloud_instance_changed(self, record: InstanceRecord) -> None:
        if record.state == "terminated" and self.instance_runs is not None:
            self.instance_runs.settle([record.instance_id])

    def _select_provider(self, log_dir: Path) -> LocalProvider | PrefectLocalProvider:
        if self.config.instances == "prefect":
            from infra.fleet.prefect_local import InstanceRunSpec, PrefectLocalProvider

            spec = InstanceRunSpec(
                run_id=self.run_id,
                redis_url=self.redis_url,
                model=str(self.model_path.resolve()),
                worker=self.config.worker,
                engine=self.engine,
                redis_ca_file=self._ca_path(),
            )
            return PrefectLocalProvider(
                spec,
                log_dir=log_dir,
                instance_prefix=self.instance_prefix,
                placement=self.placement,
                environment={**self.peer_environment, **self._user_code_path()},
            )
        return LocalProvider(
            self._worker_command,
            log_dir=log_dir,
            environment=self.worker_environment(),
            instance_prefix=self.instance_prefix,
            placement=self.placement,
            warm_start=self._warm_start(),
        )

    def _warm_start(self) -> WarmStart:
        """The local pools whose instances fork from a template that imported the worker and its
        engine once (`fabric.fork_instances`): those that hold no GPU slot (a placed instance starts
        fresh); with a vLLM pool among them the template imports vLLM too."""
        pools = [
            pool
            for pool in self.config.pools
            if self.config.fork_instances
            and pool.provider == "local"
            and not pool.colocated
            and pool.name not in self.placement
        ]
        vllm = any(pool.engine_spec(self.engine).kind == "vllm" for pool in pools)
        return WarmStart(
            pools=frozenset(pool.name for pool in pools), preload=VLLM_WORKER_MODULES if vllm else HF_WORKER_MODULES
        )

    def worker_environment(self) -> dict[str, str]:
        """What a local instance's environment adds: the run's Redis (the URL carries its password,
        so it stays off the command line), the CA of a rediss:// Redis, the weights secret, the
        directories of the run's own modules on `PYTHONPATH`."""
        environment = {REDIS_URL_ENV: self.redis_url, **self.peer_environment, **self._user_code_path()}
        if self.redis_ca_file is not None:
            environment[REDIS_CA_FILE_ENV] = str(self.redis_ca_file)
        return environment

    def _user_code_path(self) -> dict[str, str]:
        """`PYTHONPATH` with the directories of the run's own modules (none: nothing to add)."""
        path = python_path(self.user_code, os.environ.get("PYTHONPATH"))
        return {} if path is None else {"PYTHONPATH": path}

    def _ca_path(self) -> str | None:
        return None if self.redis_ca_file is None else str(self.redis_ca_file)

    def _worker_command(self, pool: PoolSpec, instance_id: str) -> list[str]:
        """A local instance's command line; the secrets (the Redis URL with its password, the weights
        secret) reach it through its environment, never here."""
        return [
            sys.executable,
            "-m",
            "infra.rollout.worker",
            "--run-id",
            self.run_id,
            *instance_flags(InstanceSpec.of_pool(instance_id, pool)),
            "--model",
            str(self.model_path),
            "--engine",
            pool.engine_spec(self.engine).model_dump_json(),
            *worker_flags(self.config.worker),
        ]

    def publish(self, version: int, state_dict) -> None:
        """Make `version` available to the instances (served from memory at once, stored in the
        background) and announce it; returns without waiting on the network. A colocated instance
        is handed `state_dict` itself."""
        for instance in self.colocated:
            instance.offer(version, state_dict)
        self.weights.publish(version, state_dict)

    def _version_published(self, version: int, weights_sha: str) -> None:
        """The publisher encoded `version`, before announcing it: the token log refuses its tokens
        from an instance whose weights sha is another (`TokenLog.expect_weights`)."""
        self.log.expect_weights(version, weights_sha)
        self.events.published(version, weights_sha)

    def _check_health(self, watch_now: bool = False) -> None:
        """Replace failed instances (`InstanceWatch`, now if `watch_now`; the cloud fleet
        reconciles at once); fail the step when the cloud pools are no longer kept (a
        configuration or credential error), a pool's instances failed
        `fabric.max_instance_failures` times in a row, or a colocated instance stopped (its engine
        failed)."""
        if self.fleet is not None and self.fleet.failure is not None:
            raise self.fleet.failure
        replaced = self.watch.replaced
        try:
            self.watch.check(force=watch_now)
        finally:
            if self.fleet is not None and self.watch.replaced != replaced:
                self.fleet.wake()
            self.events.observe(self.provider.instances(), self.watch.replaced)
        for instance in self.colocated:
            instance.check()

    def _wait_for_instances(self) -> None:
        deadline = time.time() + self.config.ready_timeout_s
        while not self.registry.alive():
            self._check_health()
            if time.time() > deadline:
                raise TimeoutError(
                    f"no rollout instance registered within {self.config.ready_timeout_s:.0f} s; "
                    f"see the instance logs under {self.run_dir / 'instances'}"
                )
            time.sleep(0.2)

    def rollout(
        self,
        tokenizer,
        records: list[PromptRecord],
        step: int,
        version: int,
        rollout: RolloutConfig,
        run_seed: int,
        on_group: Callable[[list[Sample]], None] | None = None,
        prompt: PromptConfig = PromptConfig(),
        staleness: int = 0,
        ahead: Sequence[tuple[int, list[PromptRecord]]] = (),
        environment: EnvironmentSpec | None = None,
        infra_failed: str = "drop_group",
    ) -> tuple[list[Sample], StepReport]:
        """Roll out one step on the instances; samples of delivered groups, sorted by id. Each
        complete group also goes to `on_group` (its samples in order) as soon as it is done.
        Prompts are encoded as `prompt` says; its stop strings travel in each group's sampling.
        With bounded staleness (`staleness` K >= 1) the step takes tokens of versions >=
        `version` - K, and the `ahead` steps (step, prompts) are admitted too: the instances
        generate them while this one finishes and trains, each from versions >= its step - 1 - K.
        With `environment` (its problem left blank: each group gets its record's) each sample is a
        multi-turn trajectory; a group whose trajectory failed for the infrastructure is handled as
        `infra_failed` says (`training.infra_failed`)."""
        self._step = step
        sampling = {"temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": rollout.top_k}
        if prompt.stop:
            sampling["stop"] = list(prompt.stop)

        def groups_of(step: int, records: list[PromptRecord]) -> list[GroupSpec]:
            return [
                GroupSpec(
                    group,
                    encode_prompt(tokenizer, record.prompt, prompt),
                    rollout.group_size,
                    rollout.max_new_tokens,
                    seed=step_seed(run_seed, step),
                    sampling=sampling,
                    environment=None
                    if environment is None
                    else replace(environment, prompt=record.prompt, answer=record.answer),
                    infra_failed=infra_failed,
                )
                for group, record in enumerate(records)
            ]

        groups = groups_of(step, records)
        admitted = [
            AdmittedStep(later, later - 1, max(0, later - 1 - staleness), groups_of(later, later_records))
            for later, later_records in ahead
        ]
        collected: dict[int, list[Sample]] = {}
        lock = threading.Lock()

        def deliver(group_id: int, group_records) -> None:
            with lock:
                if group_id in collected:  # its delivery mark was lost with the last second of a Redis
                    return
            samples = sorted(samples_of_group(group_records), key=lambda s: int(s.sample_id.rsplit("/", 1)[1]))
            if on_group is not None:
                on_group(samples)
            with lock:
                collected[group_id] = samples

        while True:
            try:
                self._check_health(watch_now=True)  # what failed since the last step's rollout
                self._wait_for_instances()
                report = self.controller.run_step(
                    step,
                    version,
                    groups,
                    deliver,
                    check=self._check_health,
                    min_version=max(0, version - staleness),
                    ahead=admitted,
                    staleness=staleness,
                )
                self._check_health(watch_now=True)  # the step's count of replaced instances, to its end
                break
            except REDIS_ERRORS as error:  # Redis restarting: resume the step once it answers
                log.warning(
                    "step %d lost its Redis at %s (%s): waiting up to %.0f s for it",
                    step,
                    public_url(self.redis_url),
                    error,
                    self.config.redis_outage_timeout_s,
                )
                wait_for_redis(self.redis, self.redis_url, self.config.redis_outage_timeout_s, error)
        if step > self.config.retain_steps:
            self._through_outage(lambda: self.controller.retire(step - self.config.retain_steps))
        return [s for group in sorted(collected) for s in collected[group]], report

    def groups_done(self, steps: Sequence[int]) -> dict[int, int]:
        """Complete groups of each of `steps` that the token log holds (0 for one not admitted)."""

        def count() -> dict[int, int]:
            done = {}
            for step in steps:
                try:
                    done[step] = self.log.step_status(step).groups_done
                except KeyError:
                    done[step] = 0
            return done

        return self._through_outage(count)

    def preemptions(self) -> int:
        return sum(1 for r in self.provider.instances() if r.reason in ("preempted", "preempted_silent"))

    def replaced(self) -> int:
        """Failed instances replaced so far (`InstanceWatch.replaced`)."""
        return self.watch.replaced

    def registered(self) -> dict[str, float]:
        """When each registered instance's worker registered (the registry's clock, epoch seconds):
        the ledger's ready times."""
        snapshots = self._through_outage(self.registry.all)
        return {s.spec.instance_id: s.registered_at for s in snapshots}

    def drain_transfers(self) -> list[Transfer]:
        """Weight pulls the instances reported since the last call, bytes summed per instance,
        version and kind of source: `trainer`, `store` or `peer` (with the longest pull's seconds)."""

        def source(url: str) -> str:
            return "trainer" if url == self.weights.url else url if url == STORE else "peer"

        merged: dict[tuple[str, int, str], Transfer] = {}
        for t in self._through_outage(lambda: drain_transfers(self.redis, self.run_id)):
            key = (t.instance_id, t.version, source(t.source))
            seen = merged.get(key)
            merged[key] = replace(
                t,
                source=key[2],
                nbytes=t.nbytes + (seen.nbytes if seen else 0),
                full_fallbacks=t.full_fallbacks + (seen.full_fallbacks if seen else 0),
                source_fallbacks=t.source_fallbacks + (seen.source_fallbacks if seen else 0),
                seconds=max(t.seconds, seen.seconds if seen else 0.0),
            )
        return list(merged.values())

    def offload_state(self) -> dict:
        """The controller's learned offload state (`OffloadController.to_dict`: the checkpoint keeps it)."""
        return self._through_outage(lambda: self.controller.offload.to_dict())

    def _through_outage(self, call: Callable[[], Any]) -> Any:
        """`call()`, once more after Redis answers again if it failed on a lost Redis
        (`RedisUnreachable` past `redis_outage_timeout_s`)."""
        try:
            return call()
        except REDIS_ERRORS as error:
            wait_for_redis(self.redis, self.redis_url, self.config.redis_outage_timeout_s, error)
            return call()

    def close(self) -> None:
        """Drain and delete the cloud instances, shut the local ones down, finish the publisher,
        stop the colocated instances, then Redis: each step runs even if one before it fails."""
        self._resources.close()

    def _stop_fleet(self) -> None:
        """Stop the cloud fleet: drain its instances, settle their flow runs, remove the secrets."""
        runs, fleet = self.instance_runs, self.fleet
        assert runs is not None and fleet is not None
        timeout_s = self.config.cloud.drain_timeout_s
        fleet.stop(drain=lambda live: runs.drain(live, timeout_s))
        runs.settle(runs.known(), "ended with the training run before it started this run")
        runs.remove_environment()

    def _close_weights(self) -> None:
        """Finish the publisher's pending work and stop it. A publication that failed on a lost
        Redis goes to the run log: the step that met the lost Redis ends the run (`RunStopped`), or
        the run had ended, and the instances it was for are going too."""
        try:
            self.weights.close()
        except PublishError as error:
            if not lost_redis(error):
                raise
            log.info("closing the weights publisher: %s", error, exc_info=error)
