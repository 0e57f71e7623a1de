"""The boot script of a cloud instance (GCE `startup-script`, Azure custom data).

`render_startup_script` writes a bash script that installs the project into a virtual environment
(or, with `install: null`, uses the one baked into the image) and then runs, under the preemption
watcher of its cloud (`python -m infra.watchers gce|azure`), a Prefect process worker for the
instance's pool that polls only the instance's own work queue (`<run id>-<instance id>`, where the
run's `rollout-instance/<pool>` flow run for this instance waits: `infra.fleet.instance_runs`) and exits
when that one run ends (`python -m infra.stack.prefect_worker --run-once`; the run is created before the
VM, so it is waiting when the worker first polls). The watcher
turns the cloud's preemption notice into SIGTERM for the worker, which passes it to the flow run and
waits for it to drain. Every value is shell-quoted; the script carries no credentials: the VM
reaches Prefect with its image's configuration, and the run's secrets (Redis URL, weights secret)
come from a Prefect Secret block named in the flow run's parameters.
"""

from __future__ import annotations

import shlex
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from infra.providers.interface import instance_work_queue
from infra.providers.pool import PoolSpec
from infra.services.redis_embedded import REDIS_CA_FILE_ENV

WatcherKind = Literal["gce", "azure"]


class WorkerBootstrap(BaseModel):
    """How a cloud instance installs the project and joins its pool's Prefect work pool."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    install: str | None = Field("rlboost[gcp,azure]", min_length=1)
    """pip requirement of the project, e.g. `rlboost[gcp] @ git+https://github.com/you/rlboost@v0.1.0`;
    None: the image already has it installed in `<install_dir>/venv` (the fastest boot)."""
    prefect_api_url: str | None = None
    """`PREFECT_API_URL` of the workers (None: the training process's own, which must be reachable
    from the VMs; Prefect Cloud needs `PREFECT_API_KEY` configured in the image)."""
    install_dir: str = "/opt/rlboost"
    """Where the virtual environment is created (`<install_dir>/venv`)."""
    python: str = "python3"
    """Interpreter that creates the virtual environment (3.11 or newer)."""
    grace_s: float = Field(25.0, gt=0)
    """After the notice, how long the worker may drain before it is killed (both clouds give 30 s)."""
    redis_ca_pem: str | None = None
    """PEM of the CA of a rediss:// Redis, written to `<install_dir>/redis-ca.pem` on the VM and
    named by `RLBOOST_REDIS_CA_FILE`; None: the run fills it from `fabric.redis_ca_file`."""


def render_startup_script(
    bootstrap: WorkerBootstrap, *, pool: PoolSpec, instance_id: str, run_id: str, watcher: WatcherKind
) -> str:
    """The boot script of one instance of `pool`."""
    q = shlex.quote
    venv = f"{bootstrap.install_dir.rstrip('/')}/venv"
    env = {
        "RLBOOST_RUN_ID": run_id,
        "RLBOOST_POOL": pool.name,
        "RLBOOST_INSTANCE_ID": instance_id,
        "RLBOOST_CAPACITY_CLASS": pool.capacity_class,
    }
    if bootstrap.prefect_api_url is not None:
        env["PREFECT_API_URL"] = bootstrap.prefect_api_url
    watch = [
        f"{venv}/bin/python",
        "-m",
        "infra.watchers",
        watcher,
        *(["--instance", instance_id] if watcher == "azure" else []),
        "--grace-s",
        str(bootstrap.grace_s),
        "--",
        f"{venv}/bin/python",
        "-m",
        "infra.stack.prefect_worker",
        "--pool",
        pool.name,
        "--work-queue",
        instance_work_queue(run_id, instance_id),
        "--name",
        instance_id,
        "--limit",
        "1",
        "--run-once",
    ]
    install = (
        []
        if bootstrap.install is None
        else [
            f"{q(bootstrap.python)} -m venv {q(venv)}",
            f"{q(venv + '/bin/python')} -m pip install --quiet {q(bootstrap.install)}",
        ]
    )
    lines = [
        "#!/bin/bash",
        f"# rlboost rollout instance {instance_id} of pool {pool.name}: install, then serve the pool's work queue.",
        "set -euo pipefail",
        *(f"export {key}={q(value)}" for key, value in env.items()),
        *_redis_ca_lines(bootstrap),
        # The work pool's flow-run command is `python -m prefect.engine`: the project's interpreter.
        f'export PATH={q(venv + "/bin")}:"$PATH"',
        *install,
        "exec " + " ".join(q(part) for part in watch),
    ]
    return "\n".join(lines) + "\n"


def _redis_ca_lines(bootstrap: WorkerBootstrap) -> list[str]:
    """Write the Redis CA (a public certificate, no secret) where the instance's worker finds it."""
    if bootstrap.redis_ca_pem is None:
        return []
    path = f"{bootstrap.install_dir.rstrip('/')}/redis-ca.pem"
    return [
        f"mkdir -p {shlex.quote(bootstrap.install_dir)}",
        f"printf '%s' {shlex.quote(bootstrap.redis_ca_pem)} > {shlex.quote(path)}",
        f"export {REDIS_CA_FILE_ENV}={shlex.quote(path)}",
    ]
