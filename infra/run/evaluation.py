"""pass@k of a checkpoint, in this process or on the run's rollout fabric (`rlboost eval`, `rl-eval`).

`evaluate_checkpoint` reads a checkpoint's policy (`rl.trainer.read_policy`: every weight, or the
LoRA adapters) and scores `eval.samples` responses to each of `eval.size` held-out problems as
pass@k and avg@k. In process (`fabric=False`) one engine generates them. On the fabric the
evaluation is one step of its own fabric and key namespace (run id `<run id>-eval<step>-<hex>`:
never a training step, never the training run's staleness window or versions): the run's pools
are launched (spot ones preempted as they come), the checkpoint is published as version `step`,
and the problems are enqueued as groups of `eval.samples` samples, which migrate with their
logged tokens like any sample. Both draw each sample with the same id and seed
(`rl.evaluation.evaluation_requests`), so the keyed sampler gives the same estimates either way.
The fabric's instances are billed in the ledger as their own run (`<run name>-eval`), one step:
its total is the evaluation's eval $; they get the run's own reward and environment modules as the training
fabric's do (`infra.run.user_code`). `track` logs a result to the run's experiment trackers.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from infra.ledger.recorder import Ledger
from infra.run.accounting import RunAccounting
from infra.run.config import RunConfig
from infra.run.eval_result import EvalResult
from infra.run.fabric import RolloutFabric
from infra.run.identity import stored_identity
from infra.run.preflight import in_process_engine_device
from infra.run.session import trajectory_spec
from infra.run.user_code import user_code
from infra.tracking.fanout import open_trackers
from rl.checkpoint import damage, latest_checkpoint
from rl.devices import resolve_device
from rl.engine_factory import build_engine
from rl.environments.registry import EnvironmentFactory
from rl.evaluation import eval_seed, evaluate_pass_at_k, sample_correct
from rl.export import checkpoint_step
from rl.models import load_policy, load_tokenizer
from rl.pass_at_k import Estimates, estimate
from rl.prompt_source import PromptSource
from rl.stops import StopStrings
from rl.trainer import read_policy


class NoSuchCheckpoint(ValueError):
    """The run has no (complete) checkpoint of that step; the message lists those it has."""


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint of `step` under `run_dir/checkpoints` (None: the newest complete one)."""
    root = Path(run_dir) / "checkpoints"
    if step is None:
        found = latest_checkpoint(root)
    else:
        found = root / f"step_{step:06d}"
        found = found if found.is_dir() and damage(found) is None else None
    if found is not None:
        return found
    steps = sorted(checkpoint_step(p) for p in root.glob("step_*") if p.is_dir() and damage(p) is None)
    if not steps:
        raise NoSuchCheckpoint(
            f"run {Path(run_dir).name} has no checkpoint yet ({root}): a run writes one every "
            "run.checkpoint_every steps and after its last step; evaluate it once it has one"
        )
    raise NoSuchCheckpoint(
        f"run {Path(run_dir).name} has no checkpoint of step {step} ({root}): give --checkpoint one of "
        f"{', '.join(map(str, steps))}, or leave it out for the newest"
    )


FabricWatch = Callable[[RolloutFabric], AbstractContextManager[object]]
"""A context the fabric's rollout runs inside, given the fabric (a bench's or test's preemptions)."""


def evaluate_checkpoint(
    config: RunConfig, checkpoint: Path, *, fabric: bool, during: FabricWatch | None = None
) -> EvalResult:
    """pass@k and avg@k of `checkpoint` (a `step_NNNNNN` directory of the run `config` trained),
    on the run's fabric (`fabric`; its rollout inside `during(fabric)`) or in this process;
    written under the run's `evals/`."""
    step = checkpoint_step(checkpoint)
    tokenizer = load_tokenizer(config.model.path, config.model.gguf_file)
    records = PromptSource(config.data, chat=config.prompt.chat_template).eval_records(config.eval.size)
    state = read_policy(checkpoint, config.model.lora)
    started = time.perf_counter()
    if fabric:
        result = _on_fabric(config, tokenizer, records, step, state, during or (lambda _: nullcontext()))
    else:
        estimates = _in_process(config, tokenizer, records, step, state)
        result = _result(config, step, "in_process", estimates, time.perf_counter() - started)
    result = result.model_copy(update={"checkpoint": str(checkpoint), "seconds": time.perf_counter() - started})
    result.write(config.run.directory)
    return result


def _result(config: RunConfig, step: int, where, estimates: Estimates, seconds: float, **fabric) -> EvalResult:
    return EvalResult(
        run=config.run.name,
        step=step,
        where=where,
        pass_at_k=estimates.pass_at_k,
        avg_at_k=estimates.avg_at_k,
        problems=estimates.problems,
        samples=estimates.samples,
        temperature=config.eval.temperature,
        seconds=seconds,
        **fabric,
    )


def _in_process(config: RunConfig, tokenizer, records, step: int, state) -> Estimates:
    """The estimates of policy `state` (version `step`) from one engine in this process."""
    environment, prompt = trajectory_spec(config, tokenizer)
    spec = config.engine_spec().model_copy(update={"device": in_process_engine_device(config)})
    model = load_policy(config.model.path, config.model.gguf_file) if spec.kind == "hf" else None
    engine = build_engine(
        spec,
        config.model.path,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_batch_size=config.rollout.max_batch_size,
        model=model,
    )
    try:
        engine.load_weights(state, step)
        return evaluate_pass_at_k(
            StopStrings(engine, tokenizer),
            tokenizer,
            records,
            config.eval,
            step=step,
            max_new_tokens=config.rollout.max_new_tokens,
            run_seed=config.run.seed,
            prompt=prompt,
            environment=EnvironmentFactory(environment.path, dict(environment.args)) if environment else None,
            max_turns=environment.max_turns if environment else 1,
        )
    finally:
        engine.close()


def track(config: RunConfig, result: EvalResult, invocation: str) -> dict[str, int]:
    """Log `result` to the run's trackers (`tracking:`) at its step, under `eval/`, continuing the
    tracker runs the training left (`tracking.json`; else new ones named `<run name>-<invocation>`:
    the flow run's id); what each dropped (`Trackers.finish`)."""
    trackers = open_trackers(config.tracking, config.run.name, config.run.directory, invocation)
    try:
        trackers.log_metrics(result.step, result.metrics())
        return trackers.finish(result.step, {})
    finally:
        trackers.close()


def _on_fabric(config: RunConfig, tokenizer, records, step: int, state, during: FabricWatch) -> EvalResult:
    """The evaluation of policy `state` (version `step`) as one step of its own fabric, billed in
    the ledger as its own run."""
    identity = stored_identity(config.run.directory)
    run_id = f"{identity.run_id if identity else config.run.name}-eval{step}-{uuid.uuid4().hex[:6]}"
    environment, prompt = trajectory_spec(config, tokenizer)
    samples_per_problem = config.eval.samples
    rollout = config.rollout.model_copy(  # the evaluation's sampling (`rl.evaluation.eval_sampling`)
        update={"group_size": samples_per_problem, "temperature": config.eval.temperature, "top_p": 1.0, "top_k": 0}
    )
    started = time.perf_counter()
    with Ledger(config.ledger.resolved_url()) as ledger:
        fabric = RolloutFabric(
            config.fabric,
            run_id,
            config.run.directory / "evals" / run_id,
            config.model.path,
            engine=config.engine_spec(),
            trainer_device=str(resolve_device(config.model.device, "model.device")),
            user_code=user_code(config),
            run_name=f"{config.run.name}-eval",
        )
        accounting = None
        try:
            accounting = RunAccounting(
                ledger,
                run_id,
                f"{config.run.name}-eval",
                config.fabric.pools,
                fabric.provider,
                transfers=fabric.drain_transfers,
                ready=fabric.registered,
                trainer=config.ledger.trainer,
            )
            fabric.publish(step, state)
            accounting.begin_step(step)
            with during(fabric):
                samples, report = fabric.rollout(
                    tokenizer,
                    records,
                    step,
                    step,
                    rollout,
                    eval_seed(config.run.seed),
                    prompt=prompt,
                    environment=environment,
                    infra_failed="renormalize",  # a trajectory failed by the infrastructure is left out, never wrong
                )
            accounting.end_step(step, 0, dict(report.instance_tokens), report.tokens_wasted)
            preemptions = fabric.preemptions()
        finally:
            fabric.close()
            if accounting is not None:
                accounting.finish()
        cost = ledger.report(run_id).total_usd  # every instance-second of its fabric, start to close
    correct: list[list[bool | None]] = [[] for _ in records]
    for sample in samples:
        correct[sample.group].append(sample_correct(sample, records[sample.group].answer, tokenizer))
    return _result(
        config,
        step,
        "fabric",
        estimate(correct, config.eval.k),
        time.perf_counter() - started,
        preemptions=preemptions,
        migrations=report.migrations,
        tokens=report.tokens_generated,
        cost_usd=cost,
        ledger_run_id=run_id,
    )
