"""One rollout instance's configuration (`WorkerConfig`) and the ``rlboost worker`` command line
that builds it (`parse_config`; `instance_flags` writes an `InstanceSpec`'s part of it); the
run-wide knobs are `infra.rollout.settings.WorkerSettings`'.
"""

from __future__ import annotations

import argparse
import os
from typing import get_args

from pydantic import Field, model_validator

from infra.availability.capacity import CapacityClass
from infra.rollout.instance import InstanceSpec, default_instance_id
from infra.rollout.settings import WorkerSettings, add_worker_flags, settings_from_flags
from infra.services.redis_embedded import REDIS_CA_FILE_ENV
from rl import env_vars
from rl.engine_spec import EngineSpec

TORCH_THREADS = 1
"""Torch intra-op threads of a worker (`--threads`): a rollout engine decodes small batches, which
contended cores run faster on one thread."""


class WorkerConfig(WorkerSettings):
    """One rollout instance: who it is, where its run is, and the `WorkerSettings` it runs with."""

    redis_url: str
    """URL of the run's Redis (token log, registry, control); may carry the password."""
    redis_ca_file: str | None = None
    """PEM file of the CA that signed a rediss:// Redis's certificate; None: the system's trust store."""
    run_id: str
    """The run whose steps this instance generates."""
    instance: InstanceSpec
    """Who this instance is (id, pool, capacity class, price), as it registers."""
    model_path: str
    """Base Hugging Face model: architecture, tokenizer, and the weights of version 0. A local
    directory, or an fsspec URL of a copy published by the training run (`infra.weights.model_source`;
    read with the run's weight-store options when it lies under the store), downloaded once."""
    engine: EngineSpec = EngineSpec()
    """The generation engine: backend, device, dtype (`rl.engine_spec`); an HF engine's batch
    defaults to `slots`."""
    poll_ms: float = Field(default=25.0, gt=0)
    """How often the current step and control messages are read; also the longest idle wait."""

    @model_validator(mode="after")
    def _run_id_is_a_hash_tag(self) -> WorkerConfig:
        if any(c in self.run_id for c in "{}") or not self.run_id:
            raise ValueError(f"run_id must be non-empty without braces: {self.run_id!r}")
        return self


def _engine_spec(text: str) -> EngineSpec:
    try:
        return EngineSpec.model_validate_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an engine spec: {exc}") from None


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="rlboost worker",
        description="Run a rollout instance: claim samples of the current step, generate, stream "
        "tokens to the token log. SIGTERM hands everything back and exits 0.",
    )
    p.add_argument(
        "--redis-url",
        default=env(env_vars.REDIS_URL),
        help=f"Redis URL (env {env_vars.REDIS_URL}; prefer the environment: a command line, and so the "
        "password in the URL, is visible to every local user)",
    )
    p.add_argument(
        "--redis-ca-file",
        default=env(REDIS_CA_FILE_ENV),
        help=f"PEM file of the CA of a rediss:// Redis (env {REDIS_CA_FILE_ENV}; default: the system's trust store)",
    )
    p.add_argument("--run-id", default=env(env_vars.RUN_ID), help=f"run id (env {env_vars.RUN_ID})")
    p.add_argument(
        "--instance-id",
        default=env(env_vars.INSTANCE_ID),
        help=f"instance id (env {env_vars.INSTANCE_ID}; default <pool>-<host>-<pid>)",
    )
    p.add_argument("--pool", default=env(env_vars.POOL), help=f"pool name (env {env_vars.POOL})")
    identity = InstanceSpec.model_fields
    capacity_class = identity["capacity_class"].default
    p.add_argument(
        "--capacity-class",
        default=env(env_vars.CAPACITY_CLASS, capacity_class),
        choices=list(get_args(CapacityClass)),
        help=f"env {env_vars.CAPACITY_CLASS} (default {capacity_class})",
    )
    p.add_argument("--price-per-hour", type=float, default=identity["price_per_hour"].default)
    p.add_argument("--model", required=True, help="base HF model directory or URL (version 0)")
    add_worker_flags(p)
    defaults = WorkerConfig.model_fields
    p.add_argument(
        "--engine",
        type=_engine_spec,
        default=EngineSpec(),
        help='the engine, as EngineSpec JSON, e.g. \'{"kind": "vllm", "device": "cpu", "dtype": "bf16"}\' (default hf)',
    )
    p.add_argument("--poll-ms", type=float, default=defaults["poll_ms"].default)
    p.add_argument(
        "--threads", type=int, default=TORCH_THREADS, help=f"torch intra-op threads (default {TORCH_THREADS})"
    )
    p.add_argument("--log-level", default="INFO")
    return p


def instance_flags(spec: InstanceSpec) -> list[str]:
    """The `rlboost worker` flags that make an instance `spec`."""
    return [
        "--instance-id",
        spec.instance_id,
        "--pool",
        spec.pool,
        "--capacity-class",
        spec.capacity_class,
        "--price-per-hour",
        str(spec.price_per_hour),
    ]


def parse_config(argv: list[str] | None = None) -> tuple[WorkerConfig, argparse.Namespace]:
    """The `WorkerConfig` of ``rlboost worker``'s arguments, and the arguments (threads, log level)."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("redis_url", "run_id", "pool"):
        if not getattr(args, name):
            parser.error(f"--{name.replace('_', '-')} is required (or its environment variable)")
    config = WorkerConfig(
        redis_url=args.redis_url,
        redis_ca_file=args.redis_ca_file,
        run_id=args.run_id,
        instance=InstanceSpec(
            instance_id=args.instance_id or default_instance_id(args.pool),
            pool=args.pool,
            capacity_class=args.capacity_class,
            price_per_hour=args.price_per_hour,
        ),
        model_path=args.model,
        engine=args.engine,
        poll_ms=args.poll_ms,
        **settings_from_flags(args),
    )
    return config, args
