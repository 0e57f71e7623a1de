"""How a cloud instance installs the project and joins its pool's work pool: `WorkerBootstrap`,
the `fabric.cloud.bootstrap` section of a run configuration.

A configuration model apart from the boot script that reads it (`infra.providers.startup`), so
that loading a configuration does not load what the boot script names (the Prefect worker).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class WorkerBootstrap(BaseModel):
    """How a cloud instance installs the project and joins its pool's Prefect work pool."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    install: Literal["wheel", "image"] = "wheel"
    """`wheel`: the VM installs the run's own wheel and dependency lock, which the run builds from
    its source checkout (or takes from `wheel`) and uploads to the weight store with their sha256;
    `image`: the image already has the project in `<install_dir>/venv` (you keep it in step with
    the training run's code)."""
    wheelhouse: bool = True
    """With `install: wheel`, also ship every locked dependency as a wheelhouse (built with `pip
    wheel` on the training machine, which must be Linux like the VMs, cached, uploaded beside the
    wheel) that the VMs install from with no index; False: the VMs install the lock from the index."""
    wheel: str | None = None
    """A prebuilt wheel of this project to ship instead of building one from the checkout (needed
    when rlboost is installed from a wheel, not from a source checkout)."""
    prefect_api_url: str | None = None
    """`PREFECT_API_URL` of the workers (None: the training process's own, which must be reachable
    from the VMs; Prefect Cloud needs `PREFECT_API_KEY` configured in the image)."""
    install_dir: str = "/opt/rlboost"
    """Where the boot files (`<install_dir>/boot`) and the virtual environment (`<install_dir>/venv`) go."""
    python: str = "python3"
    """Interpreter that creates the virtual environment; if it is missing or older than 3.11 the VM
    installs Python 3.11 with `uv` when the image has uv, else the boot fails."""
    grace_s: float = Field(25.0, gt=0)
    """After the notice, how long the worker may drain before it is killed (both clouds give 30 s)."""
    redis_ca_pem: str | None = None
    """PEM of the CA of a rediss:// Redis, written to `<install_dir>/redis-ca.pem` on the VM and
    named by `RLBOOST_REDIS_CA_FILE`; None: the run fills it from `fabric.redis_ca_file`."""
