"""What each cloud VM of a run boots with: its flow run, the run's code, its GPU check.

`CloudBoot` is the `BootHooks` of a run's cloud providers. At start (`ship`) it builds the run's
wheel once (`infra.fleet.code_bundle`), writes a dependency lock for each set of extras its pools
need (the pool's cloud, the store's fsspec backend, vLLM for vLLM pools: `vllm-cuda` on a GPU)
with its wheelhouse (`infra.fleet.wheelhouse`), and the run's own modules outside the project
(`user_code`: a user's reward or environment package), and uploads them to `<store>/code/` with
their sha256. Before each VM is created (`before_boot`) it creates the VM's `rollout-instance` flow run
(`InstanceRuns`) and returns the VM's `BootPlan`: the files to fetch and verify, the flow run's id
(boot failures are reported there), and a GPU check when the pool's engine runs on CUDA (a
machine type with GPUs and device `auto`, or an explicit `cuda`: `PoolSpec.engine_spec`).

To ship another file to every VM (e.g. a CA certificate), upload it with `code_bundle.upload(path,
store, options, env="NAME")` in `ship` and add the `BootFile` to `self.files`: the boot script
fetches it, checks its sha256 and exports its local path as `$NAME`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from infra.fleet import code_bundle, wheelhouse
from infra.fleet.instance_runs import InstanceRuns
from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.interface import BootFile, BootPlan
from infra.providers.pool import PoolSpec
from infra.providers.startup import FLOW_RUN_ENV, LOCK_ENV, USER_CODE_ENV, WHEEL_ENV, WHEELHOUSE_ENV, fetch_command
from rl.engine_spec import EngineSpec

log = logging.getLogger(__name__)

STORE_EXTRAS = {"gs": "gcp", "gcs": "gcp", "az": "azure", "abfs": "azure", "abfss": "azure", "s3": "s3"}
"""fsspec scheme of the weight store -> the extra whose backend reads it."""


def pool_extras(pool: PoolSpec, engine: EngineSpec, store_url: str) -> frozenset[str]:
    """The project's extras a VM of `pool` needs."""
    extras = {pool.provider}
    scheme = urlsplit(store_url).scheme
    if scheme in STORE_EXTRAS:
        extras.add(STORE_EXTRAS[scheme])
    spec = pool.engine_spec(engine)
    if spec.kind == "vllm":
        extras.add("vllm-cuda" if spec.device.startswith("cuda") else "vllm")
    return frozenset(extras)


class CloudBoot:
    """The boot hooks of a run's cloud VMs (see the module docstring)."""

    def __init__(self, runs: InstanceRuns, engine: EngineSpec) -> None:
        self.runs = runs
        self.engine = engine
        self.files: dict[str, tuple[BootFile, ...]] = {}
        """Pool name -> the files its VMs fetch."""

    def ship(
        self,
        pools: Sequence[PoolSpec],
        bootstrap: WorkerBootstrap,
        store_url: str,
        options: Mapping[str, Any] | None,
        scratch: Path,
        user_code: Mapping[str, Path] | None = None,
    ) -> None:
        """Build (or reuse) the wheel, lock it for each pool's extras with its wheelhouse, upload them
        (`install: wheel`); pack and upload `user_code` (top-level module -> its source) for every pool."""
        extra: tuple[BootFile, ...] = ()
        if user_code:
            archive = code_bundle.pack_user_code(user_code, scratch)
            extra = (code_bundle.upload(archive, store_url, options, env=USER_CODE_ENV),)
            log.info("cloud VMs fetch the run's modules %s from %s", ", ".join(user_code), extra[0].url)
        self.files = {pool.name: extra for pool in pools}
        if bootstrap.install != "wheel":
            return
        wheel = Path(bootstrap.wheel) if bootstrap.wheel else code_bundle.build_wheel()
        if not wheel.is_file():
            raise code_bundle.CodeBundleError(f"fabric.cloud.bootstrap.wheel: no wheel at {wheel}")
        try:
            fetch_command(code_bundle.vm_url(store_url, options), "/dev/null")  # now, not at the first boot
        except ValueError as error:
            raise code_bundle.CodeBundleError(f"cloud pools: {error}") from None
        shipped_wheel = code_bundle.upload(wheel, store_url, options, env=WHEEL_ENV)
        locks: dict[frozenset[str], tuple[BootFile, ...]] = {}
        scratch.mkdir(parents=True, exist_ok=True)
        for pool in pools:
            extras = pool_extras(pool, self.engine, store_url)
            if extras not in locks:
                lock = scratch / f"requirements-{'-'.join(sorted(extras))}.txt"
                lock.write_text(code_bundle.lock_requirements(wheel, extras))
                shipped_lock = code_bundle.upload(lock, store_url, options, env=LOCK_ENV)
                locks[extras] = (shipped_lock, *self._wheelhouse(lock, bootstrap, store_url, options))
                for file in locks[extras]:
                    log.info("cloud VMs of extras [%s] fetch %s", ",".join(sorted(extras)), file.url)
            self.files[pool.name] = (shipped_wheel, *locks[extras], *extra)

    @staticmethod
    def _wheelhouse(
        lock: Path, bootstrap: WorkerBootstrap, store_url: str, options: Mapping[str, Any] | None
    ) -> tuple[BootFile, ...]:
        """The lock's wheelhouse, uploaded (none when `bootstrap.wheelhouse` is off, or the training
        machine cannot build one for Linux VMs: they install the lock from the index, and say so)."""
        if not bootstrap.wheelhouse:
            return ()
        if not sys.platform.startswith("linux"):
            log.warning(
                "no wheelhouse for %s: pip builds it for this %s machine, not the Linux VMs", lock.name, sys.platform
            )
            return ()
        try:
            directory = wheelhouse.build(lock, code_bundle.wheel_cache())
        except wheelhouse.WheelhouseError as error:
            log.warning("no wheelhouse for %s, the VMs install it from the index: %s", lock.name, error)
            return ()
        return (code_bundle.upload(wheelhouse.pack(directory), store_url, options, env=WHEELHOUSE_ENV),)

    def plan(self, pool: PoolSpec, flow_run_id: str) -> BootPlan:
        """The boot plan of a VM of `pool` whose flow run is `flow_run_id`."""
        return BootPlan(
            files=self.files.get(pool.name, ()),
            env={FLOW_RUN_ENV: flow_run_id},
            require_gpu=pool.engine_spec(self.engine).device.startswith("cuda"),
        )

    def before_boot(self, pool: PoolSpec, instance_id: str) -> BootPlan:
        self.runs.create(pool, instance_id)
        return self.plan(pool, str(self.runs.flow_run_id(instance_id)))

    def never_booted(self, instance_id: str, why: str) -> None:
        self.runs.never_booted(instance_id, why)
