"""Helpers shared by the tests: one of each.

* `REPO_ROOT`: the repository (tests run with it as the working directory of their subprocesses);
* `wait_for`: poll a condition until it holds, failing the test with what it waited for;
* `Clock`: epoch seconds that move only when a test says so (providers, fakes, policies);
* `tiny_shape`, `tiny_model`, `save_tiny_model`: the tests' tiny Llama (2 layers of width 64, or
  the smallest: 1 layer), built in memory or saved as a Hugging Face model directory (the base
  model of training runs, rollout instances, flows and the stack in their tests);
* `tiny_run`, `as_set_flags`: the overrides of the smallest run of the real pipeline, and the same
  as `--set key=value` arguments of `rlboost train`;
* `resumed`, `match_rate`, `run_and_release`: a generation request continued from a prefix, the
  fraction of tokens two sets of responses share, and a run that releases each sample at a chosen
  length (the engines' resume and cross-engine tests);
* `on_a_small_disk`: a command run with a small tmpfs mounted in a private mount namespace (the
  full-disk and read-only tests);
* `rollout_fabric`, `run_trainer`, `hf_on_cpu`: a `RolloutFabric`, a `Trainer` and an `HFEngine`
  with the settings of the default run configuration (its engine and trainer device; its
  temperature and checkpointing; a rollout instance's slots).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from rl.generation import GenerationEngine, GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from infra.providers.interface import InstanceRecord
    from infra.run.fabric_config import FabricConfig
    from rl.config import GRPOConfig, OptimConfig
    from rl.engine_spec import EngineSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_SECRET = "weights-secret-for-the-tests-0123456789"
"""The weight peers' shared secret in the tests (tests/infra/weights set it for every test)."""


def on_a_small_disk(disk: Path, size: str, command: list[str], read_only: bool = False) -> list[str]:
    """`command`, run with a tmpfs of `size` (e.g. `256k`), `read_only` or not, mounted on `disk`
    in a private mount namespace (`unshare -rm`: as root or in an unprivileged user namespace);
    skips the test where neither is allowed."""
    disk.mkdir(parents=True, exist_ok=True)
    mount = f"mount -t tmpfs -o {'ro,' if read_only else ''}size={size} tmpfs {shlex.quote(str(disk))}"
    if not shutil.which("unshare") or subprocess.run(["unshare", "-rm", "sh", "-c", mount]).returncode:
        pytest.skip("cannot mount a tmpfs in a private mount namespace here (unshare -rm)")
    return ["unshare", "-rm", "sh", "-c", f'{mount} && exec "$@"', "sh", *command]


def wait_for(condition: Callable[[], object], what: str = "the condition", *, timeout_s: float = 60.0) -> None:
    """Return once `condition()` is true; fail after `timeout_s` seconds (a bound generous enough
    for a 2-core machine running other tests beside this one: it costs nothing when the condition
    comes true)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.01)


def process_state(pid: int) -> str | None:
    """The state letter /proc gives process `pid` (``R``, ``S``, ``T`` stopped, ``Z`` a zombie, ...);
    None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def parent_pid(pid: int) -> int:
    """The pid of process `pid`'s parent, from /proc."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def cmdline(pid: int) -> bytes:
    """Process `pid`'s command line as /proc gives it (NUL-separated); empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class Clock:
    """Epoch seconds that move only when a test says so."""

    def __init__(self, t: float = 1_750_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


RESERVED_POOL = {
    "name": "reserved",
    "capacity_class": "reserved",
    "size": 1,
    "machine_type": "a2-highgpu-1g",
    "price_per_hour": 3.67,
}
"""One local reserved instance, as a run configuration's `fabric.pools` entry."""
POISSON_CHURN = {
    "notice_s": 1.0,
    "silent_kill_fraction": 0.5,
    "availability": {"poisson": {"mean_life_s": 4.0, "mean_gap_s": 1.0, "seed": 3}},
}
"""Spot settings that preempt a test's local instances every few seconds (half of them silently)."""


def spot_pool(size: int = 1, **settings) -> dict:
    """A local spot pool of `size` instances (`settings`: more pool keys, e.g. `POISSON_CHURN`)."""
    return {
        "name": "spot",
        "capacity_class": "spot",
        "size": size,
        "machine_type": "a2-highgpu-1g",
        "price_per_hour": 1.10,
        **settings,
    }


def tiny_shape(*, smallest: bool = False):
    """The tests' tiny Llama (width 64, 2 heads of 32): 2 layers and an MLP of 128, the model of
    the tests that train or run a fabric; `smallest`: 1 layer and an MLP of 64."""
    from rl.models import TinyLlamaShape

    if smallest:
        return TinyLlamaShape(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=64)
    return TinyLlamaShape(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)


def tiny_model(*, seed: int = 0, smallest: bool = False):
    """A fresh `tiny_shape` Llama and its tokenizer: (model, tokenizer)."""
    from rl.models import build_tiny_llama

    return build_tiny_llama(tiny_shape(smallest=smallest), seed=seed)


def save_tiny_model(path: Path, shape=None, seed: int = 0) -> Path:
    """A tiny Llama (`shape`, default the smallest `tiny_shape`) and its tokenizer saved as a
    Hugging Face model directory at `path`."""
    from rl.models import build_tiny_llama, save_model

    model, tokenizer = build_tiny_llama(shape or tiny_shape(smallest=True), seed=seed)
    save_model(model, tokenizer, path)
    return path


def tiny_run(
    model: Path | str,
    tmp_path: Path,
    name: str = "tiny",
    steps: int | None = 1,
    overrides: dict[str, object] | None = None,
) -> dict[str, object]:
    """The dotted-key overrides of a tiny run: the smallest run of the real pipeline (the loaded
    configuration's values otherwise, the demo's for `load_config(None, ...)` and the flow) that
    still goes once through the whole loop: generate, score, train, publish the weights, evaluate
    and checkpoint. Its defaults, and why:

    * `model.path`: `model`, the test's base model (`save_tiny_model`);
    * `run.output_dir`: `tmp_path / "runs"`, so the run's directory is `tmp_path / "runs" / name`;
    * `run.name`: `name`;
    * `run.steps`: `steps`; one step already runs every part of the loop once;
    * `run.checkpoint_every`, `eval.every`: `steps`; the loop checkpoints and evaluates after the
      last step (and evaluates before the first) anyway, so a run pays for each once, no more;
    * `rollout.prompts_per_step`, `rollout.group_size`: 4 and 4, 16 samples a step: a group of 4
      gives GRPO's group-relative advantage a spread of rewards, and 4 groups still spread over
      the demo fabric's 3 instances;
    * `eval.size`: 8 held-out problems: the evaluation runs and reports, at little cost.

    The fabric, `rollout.max_new_tokens` and the ledger are the configuration's: a test that needs
    another value passes it in `overrides`, which win over the defaults; a key given as None is
    left out, to keep the configuration's value (e.g. the demo's batch). `steps=None` leaves
    `run.steps`, `run.checkpoint_every` and `eval.every` to the configuration too (a session the
    test drives step by step)."""
    run: dict[str, object] = {
        "model.path": str(model),
        "run.output_dir": str(tmp_path / "runs"),
        "run.name": name,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "eval.size": 8,
    }
    if steps is not None:
        run |= {"run.steps": steps, "run.checkpoint_every": steps, "eval.every": steps}
    run |= overrides or {}
    return {key: value for key, value in run.items() if value is not None}


def as_set_flags(overrides: dict[str, object]) -> list[str]:
    """`overrides` as the `--set key=value` arguments of `rlboost train` (values in YAML: JSON for
    sections and lists, `true`/`false` for booleans)."""
    flags = []
    for key, value in overrides.items():
        text = value if isinstance(value, str) else json.dumps(value)
        flags += ["--set", f"{key}={text}"]
    return flags


def rollout_fabric(
    config: FabricConfig, run_id: str, run_dir: Path, model_path: Path, engine: EngineSpec | None = None
):
    """The `RolloutFabric` of `config` that a session of the default run configuration makes: the
    run's engine (or `engine`), the trainer on `model.device`."""
    from infra.run.config import RunConfig
    from infra.run.fabric import RolloutFabric

    run = RunConfig()
    return RolloutFabric(
        config, run_id, run_dir, model_path, engine=engine or run.engine_spec(), trainer_device=run.model.device
    )


def run_trainer(model, pad_token_id: int, grpo: GRPOConfig, optim: OptimConfig, **settings):
    """A `Trainer` of `model` with the default `rollout.temperature` and
    `trainer.gradient_checkpointing`, or the `settings` given (and `autocast_dtype`)."""
    from rl.config import RolloutConfig, TrainerConfig
    from rl.trainer import Trainer

    defaults = {
        "temperature": RolloutConfig().temperature,
        "gradient_checkpointing": TrainerConfig().gradient_checkpointing,
    }
    return Trainer(model, pad_token_id, grpo, optim, **(defaults | settings))


def hf_on_cpu(model, eos_token_id: int, pad_token_id: int, **settings):
    """An `HFEngine` of `model` on the CPU, with a rollout instance's default `fabric.worker.slots`
    rows at once, or the `settings` given (`max_batch_size`, `policy_version`)."""
    from infra.rollout.settings import WorkerSettings
    from rl.engine import HFEngine

    defaults = {"max_batch_size": WorkerSettings().slots, "device": "cpu"}
    return HFEngine(model, eos_token_id, pad_token_id, **(defaults | settings))


def resumed(request: GenerationRequest, generated: list[int]) -> GenerationRequest:
    """`request` continued after `generated`: the same sample with those tokens as its prefix."""
    return GenerationRequest(
        request.sample_id,
        request.prompt_ids,
        request.max_new_tokens,
        request.seed,
        request.sampling,
        list(generated),
        request.stop_token_ids,
    )


def match_rate(got: list[GenerationResult], want: list[GenerationResult]) -> float:
    """Fraction of token positions (over the longer of each pair) where the responses agree."""
    same = total = 0
    for a, b in zip(got, want):
        same += sum(x == y for x, y in zip(a.token_ids, b.token_ids))
        total += max(len(a.token_ids), len(b.token_ids))
    return same / total


def run_and_release(
    engine: GenerationEngine, requests: list[GenerationRequest], stops: dict[str, int]
) -> dict[str, list[int]]:
    """Run `requests` together; release each sample once it has stops[sample_id] tokens."""
    for request in requests:
        engine.add(request)
    tokens = {r.sample_id: [] for r in requests}
    done = set()
    while engine.has_work():
        for chunk in engine.step():
            tokens[chunk.sample_id] += chunk.token_ids
            if chunk.finish_reason is not None:
                done.add(chunk.sample_id)
        for sample_id, generated in tokens.items():
            if sample_id not in done and len(generated) >= stops[sample_id]:
                assert engine.release(sample_id) == generated
                done.add(sample_id)
    return tokens


def cloud_fabric_run(pool: dict, redis_url: str, install_dir: Path, **cloud) -> dict[str, object]:
    """The overrides of a run whose one pool is a cloud fake's VMs (GCE or Azure; `cloud` names the
    fake's endpoint): 32-token responses, the run's Redis, fast workers, controller and reconcile,
    no live prices. The fakes' network is this machine: plain Redis and Prefect are opted into, and
    the weights between the "VMs" and the trainer still go over HTTPS."""
    return {
        "rollout.max_new_tokens": 32,
        "fabric.enabled": True,
        "fabric.pools": [pool],
        "fabric.redis_url": redis_url,
        "fabric.allow_plaintext": True,
        "fabric.weights": {"tls": True},
        "fabric.worker": {"slots": 8, "flush_tokens": 2, "flush_ms": 50, "heartbeat_s": 0.3, "ttl_s": 3.0},
        "fabric.controller": {"reap_timeout_s": 3.0},
        "fabric.cloud": {
            # The fakes' image has every dependency (bake_image_venv): no wheelhouse of torch to build.
            "bootstrap": {"install_dir": str(install_dir), "grace_s": 20.0, "wheelhouse": False},
            "live_prices": False,
            "reconcile_s": 0.5,
            "drain_timeout_s": 60.0,
            **cloud,
        },
    }


class RecordedInstances:
    """The provider's side `RunAccounting` reads: the instances it has records of."""

    def __init__(self, *records: InstanceRecord) -> None:
        self.records = list(records)

    def instances(self) -> list[InstanceRecord]:
        return self.records
