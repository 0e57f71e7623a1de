"""Checks of a run's configuration against this machine, before the run starts any work:
`preflight(config)` runs in `rlboost train` / `rlboost demo` before Prefect starts, and again when a
training session opens (a run started from a deployment has no CLI in front of it). It fails with a
`PreflightError` whose message names the configuration field and the fix, for: a base model that is
not there (or a GGUF file where the rollout instances need a Hugging Face directory); a DeepSpeed
trainer without DeepSpeed, with more ranks than GPUs or a rendezvous it cannot host; a device absent
here or a dtype it cannot run; an engine that cannot run the model (vLLM missing, the wrong vLLM build
for the device, a head size vLLM's CPU kernels refuse, a colocated vLLM engine beside the in-process
one in the same process); local pools asking for more GPUs than the node has (`gpus_per_instance`,
`infra.providers.placement`); a pool's availability trace that is unknown, missing or corrupt; a run
to resume whose `identity.json` or every checkpoint is damaged, or whose checkpoints are of the other
kind (LoRA adapters against full fine-tuning); `model.lora.target_modules` naming a layer the model
lacks; a tool environment with a chat template that cannot render tool calls; cloud pools that would
reach the run in plain text or through an unauthenticated Prefect server (`check_cloud_transport`);
a required experiment tracker without its library or its server (`infra.tracking.preflight`).
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import torch

from infra.availability.traces import load_trace
from infra.providers.placement import PlacementError, plan_node
from infra.providers.pool import PoolSpec, TraceAvailability
from infra.run.config import RunConfig
from infra.run.identity import stored_identity
from infra.tracking.preflight import check_tracking
from rl.checkpoint import CorruptCheckpoint, latest_checkpoint
from rl.config import TrainerConfig, split_endpoint
from rl.devices import DeviceError, resolve_device, resolve_dtype
from rl.engine_factory import check_engine
from rl.engine_spec import EngineSpec
from rl.environments.tool_calls import ToolFormatError, make_tool_format
from rl.lora import check_targets, read_settings
from rl.models import load_tokenizer
from rl.prompts import check_chat_template
from rl.trainer import check_lora_matches, lora_record


class PreflightError(ValueError):
    """A run that cannot start as configured; the message names the field and the fix."""


def in_process_engine_device(config: RunConfig) -> str:
    """The in-process engine's device: `rollout.device`, where `auto` is the trainer's device."""
    return config.model.device if config.rollout.device == "auto" else config.rollout.device


def preflight(config: RunConfig) -> None:
    """Raise `PreflightError` when the run cannot start on this machine as configured."""
    try:
        _check_model(config)
        device = resolve_device(config.model.device, "model.device")
        resolve_dtype(config.model.dtype, device, "model.dtype")
        model = config.model
        in_process = config.engine_spec().model_copy(update={"device": in_process_engine_device(config)})
        check_engine(in_process, model.path, "rollout.engine", model.gguf_file)
        if in_process.kind == "hf":
            resolve_device(in_process.device, "rollout.device")
        _check_trainer(config, device)
        _check_lora(config)
        _check_tool_format(config)
        if config.fabric.enabled:
            _check_pools(config)
            check_cloud_transport(config)
        stored_identity(config.run.directory)  # a damaged identity.json is refused now
        latest_checkpoint(config.run.directory / "checkpoints")  # a damaged only checkpoint is refused now
        check_tracking(config.tracking)  # a tracker's library, its server
    except CorruptCheckpoint as exc:
        raise PreflightError(f"run.name: {exc}, or give the run another run.name") from None
    except (DeviceError, ValueError) as exc:
        raise PreflightError(str(exc)) from None


def _check_model(config: RunConfig) -> None:
    path, gguf = config.model.path, config.model.gguf_file
    if not path.exists():
        raise PreflightError(
            f"model.path: {path} does not exist: `rlboost pretrain` makes the tiny model there, and "
            "`rlboost import-model` turns a GGUF or Hugging Face checkpoint into a model directory"
        )
    if gguf is not None and not (path / gguf).is_file():
        raise PreflightError(f"model.gguf_file: {path / gguf} is not a file")
    if gguf is None and not (path / "config.json").is_file():
        raise PreflightError(
            f"model.path: {path} holds no Hugging Face model (no config.json); point it at a model directory, "
            "or set model.gguf_file for a GGUF file in it"
        )


def _check_lora(config: RunConfig) -> None:
    """`model.lora.target_modules` name layers the model has; a run to resume has checkpoints of
    its own kind (adapters, or every weight: `rl.trainer.check_lora_matches`)."""
    lora = config.model.lora
    if lora is not None:
        from transformers import AutoConfig, AutoModelForCausalLM

        kwargs = {"gguf_file": config.model.gguf_file} if config.model.gguf_file else {}
        with torch.device("meta"):  # the module tree alone, no weights
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config.model.path), **kwargs))
        check_targets(model, lora, str(config.model.path))
    checkpoint = latest_checkpoint(config.run.directory / "checkpoints")
    if checkpoint is not None:
        check_lora_matches(checkpoint, {"lora": lora_record(read_settings(checkpoint))}, lora)


def _check_tool_format(config: RunConfig) -> None:
    """A tool environment with `prompt.chat_template: true` needs a chat template that renders tool
    calls and results (`rl.environments.tool_calls.ChatTemplateToolFormat`)."""
    if config.environment is None or not config.prompt.chat_template:
        return
    if not config.environment.load().uses_tools:
        return
    tokenizer = load_tokenizer(config.model.path, config.model.gguf_file)
    check_chat_template(tokenizer, config.prompt, config.model.path)
    try:
        make_tool_format(True, tokenizer)
    except ToolFormatError as error:
        raise PreflightError(
            f"prompt.chat_template: the model at {config.model.path} is asked to call tools, but {error}"
        ) from None


def _check_trainer(config: RunConfig, device) -> None:
    trainer = config.trainer
    if trainer.backend != "deepspeed":
        return
    if importlib.util.find_spec("deepspeed") is None:
        raise PreflightError(
            "trainer.backend: deepspeed needs DeepSpeed: pip install 'rlboost[deepspeed]' (or set trainer.backend: torch)"
        )
    if device.type == "cuda" and torch.cuda.device_count() < trainer.ranks_per_node:
        on_this_node = f" ({trainer.ranks_per_node} on this node)" if trainer.nodes > 1 else ""
        raise PreflightError(
            f"trainer.world_size: {trainer.world_size} ranks{on_this_node} need one GPU each; this machine has "
            f"{torch.cuda.device_count()}. Lower trainer.world_size"
        )
    if device.type not in ("cpu", "cuda"):
        raise PreflightError(f"trainer.backend: deepspeed runs on cpu or cuda, not model.device {config.model.device}")
    if trainer.nodes > 1:
        _check_rendezvous(trainer)


def _check_rendezvous(trainer: TrainerConfig) -> None:
    """This machine hosts the rendezvous (its agent's store) and the channel: it must be able to
    listen at `trainer.rendezvous` and at the channel's host (and port, when one is set)."""
    host, port = split_endpoint(str(trainer.rendezvous), "trainer.rendezvous")
    cannot = _cannot_listen(host, port)
    if cannot:
        raise PreflightError(
            f"trainer.rendezvous: this machine cannot listen at {trainer.rendezvous} ({cannot}); the training "
            "process's node hosts the rendezvous: give one of its addresses and a free port"
        )
    channel = trainer.channel_host or host
    cannot = _cannot_listen(channel, trainer.channel_port or 0)
    if cannot:
        field = (
            "trainer.channel_port" if trainer.channel_port and trainer.channel_host is None else "trainer.channel_host"
        )
        raise PreflightError(
            f"{field}: this machine cannot listen at {channel} port {trainer.channel_port or 'any'} ({cannot}); "
            "give an address of this machine that the other nodes reach, and a free port"
        )


def _cannot_listen(host: str, port: int) -> str | None:
    """Why a TCP socket cannot listen at (host, port) here; None when it can."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as error:
        return error.strerror or str(error)
    return None


def _check_pools(config: RunConfig) -> None:
    model, run_engine = config.model, config.engine_spec()
    for index, pool in enumerate(config.fabric.pools):
        field = f"fabric.pools[{index}] ({pool.name})"
        if model.gguf_file is not None:
            raise PreflightError(
                f"{field}: rollout instances load Hugging Face model directories, and model.gguf_file is set: "
                f"convert it once with `rlboost import-model {Path(model.path) / model.gguf_file} --output DIR` "
                "and point model.path at DIR (and drop model.gguf_file)"
            )
        if isinstance(pool.availability, TraceAvailability):
            _check_trace(pool.availability.trace, f"{field}.availability.trace")
        if pool.provider != "local":
            continue  # a VM's engine and device are checked where it runs, and reported in its flow run
        spec = pool.engine_spec(run_engine)
        if pool.colocated and spec.device == "auto":  # it runs on the trainer's device
            spec = spec.model_copy(update={"device": model.device})
        check_engine(spec, model.path, f"{field}.engine")
        _check_gpus(pool, spec, field)
        device = resolve_device(spec.device, f"{field}.device")
        resolve_dtype(spec.dtype, device, "model.dtype")
        in_process_vllm = run_engine.kind == "vllm" and not run_engine.vllm.multiprocessing
        if pool.colocated and spec.kind == "vllm" and in_process_vllm:
            raise PreflightError(
                f"{field}: a colocated vllm engine shares the training process with the in-process vllm engine "
                "(evaluation), and vLLM runs one in-process engine per process: set "
                "`rollout.vllm.multiprocessing: true`, or `engine: hf` on the pool"
            )
    try:
        plan_node(config.fabric.pools, config.fabric.node_gpus, torch.cuda.device_count)
    except PlacementError as exc:
        raise PreflightError(str(exc)) from None


def _check_gpus(pool: PoolSpec, spec: EngineSpec, field: str) -> None:
    """A placed pool's engine takes the GPUs it is given: one GPU for HF, a device without an index."""
    if not pool.gpus_per_instance:
        return
    if spec.kind == "hf" and pool.gpus_per_instance > 1:
        raise PreflightError(
            f"{field}.gpus_per_instance: the hf engine runs on one GPU, and the pool gives each instance "
            f"{pool.gpus_per_instance:g}: set `engine: vllm` (tensor parallel over them) or gpus_per_instance 1"
        )
    if spec.device.startswith("cuda:"):
        raise PreflightError(
            f"{field}.device: {spec.device} names a GPU, and gpus_per_instance places the pool's instances on "
            "GPUs of their own (CUDA_VISIBLE_DEVICES): set the device to cuda or auto"
        )


def check_cloud_transport(config: RunConfig, api_url: str | None = None) -> None:
    """Refuse cloud pools whose VMs would reach the run across networks in plain text or through an
    unauthenticated Prefect server (it hands them the run's secrets), unless `fabric.allow_plaintext`.
    `api_url`: the Prefect API the VMs use (default: `fabric.cloud.bootstrap.prefect_api_url`, else
    this process's). Weights between peers need no check: the run serves them over HTTPS itself."""
    fabric = config.fabric
    if not fabric.cloud_pools or fabric.allow_plaintext:
        return
    from infra.services.prefect_api import current_api_key, current_api_url, current_auth_string
    from infra.services.redis_embedded import REDIS_URL_ENV

    pool = fabric.cloud_pools[0]
    who = f"pool {pool.name!r} ({pool.provider}) has VMs that reach the run across networks"
    opt_out = "or set fabric.allow_plaintext: true if the network between them is private and trusted"
    redis_url = fabric.redis_url or os.environ.get(REDIS_URL_ENV)
    if redis_url is not None and not redis_url.startswith("rediss://"):
        raise PreflightError(
            f"fabric.redis_url: {who}, and the run's Redis is plain redis://, so the token log and its password "
            "would cross the network unencrypted: give the TLS port of the server as a rediss:// URL with "
            f"fabric.redis_ca_file (docs/security.md: Encryption and authentication), {opt_out}"
        )
    api_url = api_url or fabric.cloud.bootstrap.prefect_api_url or current_api_url()
    if api_url is None:
        return  # no server at all: the fabric refuses that with its own message
    field = "fabric.cloud.bootstrap.prefect_api_url" if fabric.cloud.bootstrap.prefect_api_url else "PREFECT_API_URL"
    if current_api_key() is None and current_auth_string() is None:
        raise PreflightError(
            f"{field}: {who}, and they read the run's secrets from the Prefect server at {api_url}, which this "
            "process reaches without credentials: start it with `rlboost up --host <interface>` (basic auth) and "
            "`export PREFECT_API_AUTH_STRING=...` as it prints, or use Prefect Cloud (PREFECT_API_KEY), "
            f"{opt_out}"
        )
    if not api_url.startswith("https://"):
        raise PreflightError(
            f"{field}: {who}, and the Prefect API {api_url} is plain HTTP, so the run's secrets and the "
            f"server's credential would cross the network unencrypted: put a TLS proxy in front of the server and "
            f"use its https:// URL, {opt_out}"
        )


def _check_trace(ref: str, field: str) -> None:
    try:
        load_trace(ref)
    except (ValueError, OSError, EOFError) as exc:  # unknown, missing or corrupt (TraceError names the file and line)
        raise PreflightError(
            f"{field}: cannot use trace {ref!r}: {exc}; fix the file or choose another trace"
        ) from None
