"""The in-process training session of one run: the long-lived policy, trainer and rollout engine,
and the per-step files that Prefect tasks exchange by path.

Prefect tasks never carry tensors. A flow opens a `TrainingSession` once, registers it under a
key, and every task receives only that key, a step number and file paths. Per step the session
writes ``<run>/steps/<step>/rollout.jsonl`` (token ids and log-probs of every sample),
``scores.json`` and ``metrics.json``; the checkpoint carries the data cursor, so a run resumed
from its latest checkpoint re-draws exactly the prompts it would have drawn.

With the fabric, each group is scored and its gradient accumulated as soon as it completes
(`rl.streaming.StreamedStep`, during the `rollout` task), so the `train` task only checks the
streamed samples against the step's scores and takes the optimizer step.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from infra.ledger.recorder import Ledger
from infra.ledger.report import CostReport
from infra.rollout.tokenlog import EnvironmentSpec
from infra.run.accounting import RunAccounting
from infra.run.config import RunConfig
from infra.run.driver_lock import session_lock
from infra.run.eval_result import EvalResult
from infra.run.fabric import RolloutFabric
from infra.run.group_progress import GroupProgress
from infra.run.identity import claim_identity
from infra.run.model_record import record_model
from infra.run.preflight import in_process_engine_device, preflight
from infra.run.redis_outage import RedisUnreachable, RunStopped
from infra.run.step_record import History, StepRecord
from infra.run.sweep import SweepSchedule, start_sweeps
from infra.run.user_code import user_code
from infra.run.workload import adapter_size, run_workload
from rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rl.config import PromptConfig
from rl.devices import resolve_device
from rl.distributed.protocol import TrainSpec
from rl.distributed.trainer import DistributedTrainer
from rl.engine_factory import build_engine
from rl.environments.registry import EnvironmentFactory
from rl.environments.tool_calls import ToolFormatError, make_tool_format
from rl.evaluation import evaluate_pass_at_k
from rl.generation import GenerationEngine
from rl.models import load_policy, load_tokenizer
from rl.prompt_source import PromptSource
from rl.prompts import check_chat_template, encode_prompt
from rl.rollout import Sample, build_requests, read_samples, samples_from_results, trajectory_figures, write_samples
from rl.scoring import NothingToTrain, score_samples
from rl.stops import StopStrings
from rl.streaming import StreamedStep, train_batch
from rl.trainer import PolicyTrainer, Trainer

PROMPTS_MEASURED = 64
"""Held-out prompts encoded to measure the mean prompt length the ledger records (`runs.workload`)."""


@dataclass
class StepPaths:
    root: Path

    @property
    def rollout(self) -> Path:
        return self.root / "rollout.jsonl"

    @property
    def scores(self) -> Path:
        return self.root / "scores.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"


class TrainingSession:
    def __init__(self, config: RunConfig) -> None:
        self.config = config
        if config.run.torch_threads:
            torch.set_num_threads(config.run.torch_threads)
        self.directory = config.run.directory
        self.directory.mkdir(parents=True, exist_ok=True)
        with ExitStack() as stack:  # what is made is closed again, in reverse, if a later part fails
            self._driver_lock = session_lock(self.directory)  # a second driver of this run is refused here
            stack.callback(self._driver_lock.release)
            self._open(config, stack)
            self._resources = stack.pop_all()
            """What `close` undoes, last made first: the engine, the fabric (after the sweeps), the
            trainer, the run's accounting, the ledger, the driver lock."""

    def _open(self, config: RunConfig, stack: ExitStack) -> None:
        """Make everything the session holds (under the run's driver lock); each part's undoing
        goes on `stack` as soon as the part exists."""
        preflight(config)
        self.device = resolve_device(config.model.device, "model.device")
        self.tokenizer = load_tokenizer(config.model.path, config.model.gguf_file)
        check_chat_template(self.tokenizer, config.prompt, config.model.path)  # before any work
        self.environment, self.rollout_prompt = trajectory_spec(config, self.tokenizer)
        self.model, self.trainer = _make_trainer(config, self.device, self.tokenizer.pad_token_id)
        stack.callback(self.trainer.close)
        self.adapter = adapter_size(self.trainer.policy_state()) if config.model.lora is not None else None
        """One adapter version's size (None: full fine-tuning, a version is every weight)."""
        self._engine: GenerationEngine | None = None
        """The in-process engine (rollout without the fabric, and evaluation), made on first use."""
        self._engine_shares_model = False
        """Whether that engine runs `self.model` itself (so it is always at the current version)."""
        stack.callback(self._close_engine)  # after the fabric, before the trainer
        self.prompts = PromptSource(config.data, chat=config.prompt.chat_template)
        self.eval_records = self.prompts.eval_records(config.eval.size)
        self.reward_fn = config.reward.load(config.data.family if config.data.source == "arithmetic" else None)
        self.correctness_fn = self.reward_fn.correctness
        self.cursor = 0
        self.history = History()
        self.resumed_from: int | None = None
        offload_state = None
        """The fabric's learned offload state at the checkpoint (a Redis that kept its own wins)."""
        checkpoint = latest_checkpoint(self.checkpoint_dir)
        if checkpoint is not None:
            state = load_checkpoint(checkpoint, self.trainer)
            self.cursor = state["cursor"]
            self.history = History.from_state(state["history"])
            self.resumed_from = self.trainer.step
            offload_state = state.get("offload")
        self.fabric: RolloutFabric | None = None
        self._stream: tuple[int, StreamedStep] | None = None
        """The step whose groups are being trained while they arrive (fabric rollout only)."""
        # The run's id is the run directory's (`infra.run.identity`): a re-run after a crash is the
        # same ledger run and the same Redis keyspace, so it resumes the step after its checkpoint
        # from the logged tokens (the fabric's take-over) and keeps the learned offload state.
        self.identity = claim_identity(self.directory, config.run.name)
        self.run_id = self.identity.run_id
        record_model(self.directory, config.model)  # the base its checkpoints belong to (`rlboost export`)
        self._step_usage: dict[int, tuple[dict[str, int], int]] = {}
        """Per step in progress: tokens each instance generated, tokens wasted (for the ledger)."""
        self._taken_over = None
        """What the dead attempt left of the first step (reported in that step's metrics)."""
        self.last_eval: EvalResult | None = None
        """The latest evaluation's pass@k and avg@k (`evaluate`)."""
        self._open_fabric(config, stack, offload_state)

    def _open_fabric(self, config: RunConfig, stack: ExitStack, offload_state: Any) -> None:
        """The ledger, the run's sweeps (cloud pools), the rollout fabric and the run's accounting."""
        ledger = Ledger(config.ledger.resolved_url())
        stack.callback(ledger.close)
        stack.callback(self._finish_accounting)  # after the fabric and the trainer are closed
        self._sweeps: SweepSchedule | None = None
        """The run's heartbeat and VM sweeps (cloud pools only): alive before any VM is launched."""
        if self.identity.resumed:  # before anything beats: the dead attempt ends at its last heartbeat
            ledger.resume_run(self.run_id)
        if config.fabric.enabled and config.fabric.cloud_pools:
            self._sweeps = start_sweeps(config.fabric, self.run_id, config.run.name, ledger)
            stack.callback(self._sweeps.stop)
        if config.fabric.enabled:
            self.fabric = RolloutFabric(
                config.fabric,
                self.run_id,
                self.directory,
                config.model.path,
                engine=config.engine_spec(),
                trainer_device=str(self.device),
                instance_prefix=self.identity.instance_prefix,
                take_over_step=self.step + 1 if self.identity.resumed else None,
                user_code=user_code(config),
                run_name=config.run.name,
            )
            stack.callback(self._close_fabric)
            self._taken_over = self.fabric.take_over
            if offload_state is not None:
                self.fabric.controller.seed_offload(offload_state)
            self.fabric.publish(self.step, self.trainer.policy_state())
        self.accounting = RunAccounting(
            ledger,
            self.run_id,
            config.run.name,
            config.fabric.pools if self.fabric else (),
            self.fabric.provider if self.fabric else None,
            transfers=self.fabric.drain_transfers if self.fabric else None,
            ready=self.fabric.registered if self.fabric else None,
            trainer=config.ledger.trainer,
            instance_prefix=self.identity.instance_prefix,
            workload=run_workload(config, _parameters(self.model), self._mean_prompt_tokens(), self.adapter),
        )

    def _close_fabric(self) -> None:
        """Stop the sweeps, then the fabric (it deletes the run's VMs)."""
        assert self.fabric is not None
        if self._sweeps is not None:
            self._sweeps.stop()  # before the fabric deletes its VMs and the run ends
        self.fabric.close()

    def _finish_accounting(self) -> None:
        accounting: RunAccounting | None = getattr(self, "accounting", None)  # None: never made
        if accounting is not None:
            accounting.finish()

    def _close_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()

    def _mean_prompt_tokens(self) -> float | None:
        """Mean tokens of the encoded prompts, over the first `PROMPTS_MEASURED` held-out ones."""
        records = self.eval_records[:PROMPTS_MEASURED]
        if not records:
            return None
        return sum(len(encode_prompt(self.tokenizer, r.prompt, self.config.prompt)) for r in records) / len(records)

    @property
    def engine(self) -> GenerationEngine:
        """The in-process engine, holding the current policy version. An HF engine in fp32 on the
        trainer's device runs the trainer's own model; any other gets the weights after each step."""
        if self._engine is None:
            self._engine = self._make_engine()
        if self._engine.policy_version != self.step:
            if self._engine_shares_model:
                self._engine.policy_version = self.step
            else:
                self._engine.load_weights(self.trainer.policy_state(), self.step)
        return self._engine

    def _make_engine(self) -> GenerationEngine:
        spec = self.config.engine_spec().model_copy(update={"device": in_process_engine_device(self.config)})
        self._engine_shares_model = (
            self.model is not None
            and spec.kind == "hf"
            and spec.dtype == "fp32"
            and resolve_device(spec.device, "rollout.device") == self.device
        )
        # A model read from disk holds version 0 (the base); `engine` brings it up to date.
        model = None  # vLLM loads the base model itself
        if spec.kind == "hf":
            if self.model is None:  # the policy lives in the DeepSpeed ranks
                model = load_policy(self.config.model.path, self.config.model.gguf_file)
            else:
                model = self.model if self._engine_shares_model else copy.deepcopy(self.model)
        engine = build_engine(
            spec,
            self.config.model.path,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            max_batch_size=self.config.rollout.max_batch_size,
            policy_version=self.step if spec.kind == "hf" and self.model is not None else 0,  # a copy of the live model
            model=model,
        )
        return StopStrings(engine, self.tokenizer)

    @property
    def checkpoint_dir(self) -> Path:
        return self.directory / "checkpoints"

    @property
    def step(self) -> int:
        """Optimizer steps done (= policy version)."""
        return self.trainer.step

    def paths(self, step: int) -> StepPaths:
        root = self.directory / "steps" / f"{step:06d}"
        root.mkdir(parents=True, exist_ok=True)
        return StepPaths(root)

    def _records(self, later: int = 0):
        """The prompts of the step in progress (`later` steps after it: a step admitted ahead):
        the next ones after the data cursor."""
        per_step = self.config.rollout.prompts_per_step
        return self.prompts.take(self.cursor + later * per_step, per_step)

    def _ahead(self, step: int, last_step: int | None) -> list[tuple[int, list]]:
        """The steps admitted while `step` rolls out and trains (bounded staleness): up to K after
        it, none past `last_step`."""
        k = self.config.training.max_staleness
        last = step + k if last_step is None else min(step + k, last_step)
        return [(later, self._records(later - step)) for later in range(step + 1, last + 1)]

    # -- the stages of one RL step ---------------------------------------------------------
    def rollout(
        self, step: int, on_progress: Callable[[int, int], None] | None = None, last_step: int | None = None
    ) -> dict:
        """Generate the step's samples (in process, or on the fabric's instances); on the fabric,
        `on_progress(groups_done, groups_total)` follows the groups as they complete
        (`GroupProgress`: after a second, at most once a second). With
        `training.max_staleness` K >= 1 the fabric admits the next K steps (up to `last_step`)
        too, so their rollout runs while this step trains."""
        started = time.perf_counter()
        self.accounting.begin_step(step)
        fabric_stats = {}
        if self.fabric is None:
            requests = build_requests(
                self.tokenizer, self._records(), step, self.config.rollout, self.config.run.seed, self.config.prompt
            )
            results = self.engine.generate(requests)
            samples = samples_from_results(requests, results, self.step)
        else:
            if self.step != step - 1:
                raise RuntimeError(f"trainer is at step {self.step}; cannot roll out step {step}")
            self._abandon_stream()
            stream = None
            if self.config.fabric.stream_training:
                stream = StreamedStep(
                    self.trainer,
                    self._records(),
                    self.tokenizer,
                    self.reward_fn,
                    self.correctness_fn,
                    self.config.grpo,
                )
                self._stream = (step, stream)
            progress = GroupProgress(len(self._records()), on_progress)

            def on_group(group: list) -> None:
                if stream is not None:
                    stream.add(group)
                progress.advance()

            replaced = self.fabric.replaced()
            with self._stops_when_redis_is_gone():
                samples, report = self.fabric.rollout(
                    self.tokenizer,
                    self._records(),
                    step,
                    self.step,
                    self.config.rollout,
                    self.config.run.seed,
                    on_group=on_group,
                    prompt=self.rollout_prompt,
                    staleness=self.config.training.max_staleness,
                    ahead=self._ahead(step, last_step),
                    environment=self.environment,
                    infra_failed=self.config.training.infra_failed,
                )
            progress.finish()
            self._step_usage[step] = (dict(report.instance_tokens), report.tokens_wasted)
            fabric_stats = {
                "tokens_wasted": report.tokens_wasted,
                "migrations": report.migrations,
                "reaped_instances": report.reaped_instances,
                "steals": report.steals,
                "rejected_appends": report.rejected_appends,
                "groups_dropped": len(report.groups_dropped),
                "t_local_s": report.t_local_s,
                "preemptions": self.fabric.preemptions(),
                "replaced": self.fabric.replaced() - replaced,
                "infra_failed": dict(report.infra_failed),
                "served_versions": dict(report.served_versions),
                "wrong_weight_instances": report.wrong_weight_instances,
                "wrong_weights": report.wrong_weights,
            }
            if self.environment is not None:
                fabric_stats.update(asdict(trajectory_figures(samples)))
            taken_over, self._taken_over = self._taken_over, None
            if taken_over is not None and taken_over.step == step:  # what the dead attempt had done
                fabric_stats.update(
                    resumed_samples_done=taken_over.samples_done, resumed_samples_partial=taken_over.samples_partial
                )
        paths = self.paths(step)
        write_samples(paths.rollout, samples)
        tokens = sum(len(s.response_ids) for s in samples)
        return {"path": str(paths.rollout), "tokens": tokens, "seconds": time.perf_counter() - started, **fabric_stats}

    def generated_ahead(self, step: int, last_step: int | None = None) -> dict:
        """Groups of the steps admitted after `step` that are complete now (bounded staleness:
        what the instances generated while `step` scored, trained and published)."""
        if self.fabric is None:
            return {"groups_done": 0, "steps": []}
        later = [s for s, _ in self._ahead(step, last_step)]
        with self._stops_when_redis_is_gone():
            done = self.fabric.groups_done(later)
        return {"groups_done": sum(done.values()), "steps": later}

    def score(self, step: int, rollout_path: str) -> dict:
        samples = read_samples(Path(rollout_path))
        if not samples:  # every trajectory failed for an infrastructure reason: none is scored 0
            raise NothingToTrain(step)
        scores = score_samples(
            samples,
            self._records(),
            self.tokenizer,
            self.reward_fn,
            self.correctness_fn,
            self.config.rollout.group_size,
            self.config.grpo,
            partial_groups=self.config.training.infra_failed == "renormalize",
        )
        path = self.paths(step).scores
        path.write_text(json.dumps(scores.__dict__))
        return {
            "path": str(path),
            "reward": sum(scores.rewards) / len(scores.rewards),
            "accuracy": sum(scores.correct) / len(scores.correct),
        }

    def train(self, step: int, rollout_path: str, scores_path: str) -> dict:
        if self.step != step - 1:
            raise RuntimeError(f"trainer is at step {self.step}; cannot train step {step}")
        samples = read_samples(Path(rollout_path))
        advantages = json.loads(Path(scores_path).read_text())["advantages"]
        started = time.perf_counter()
        batch = train_batch(samples, advantages)
        streamed = self._stream[1] if self._stream and self._stream[0] == step else None
        self._stream = None
        lag = version_lag(samples, self.step, self.config.training.max_staleness)
        metrics: dict[str, Any]
        if streamed is not None and streamed.covers(samples):
            metrics = streamed.finish(samples, advantages)
            metrics.update(streamed_groups=streamed.groups, train_overlap_s=streamed.busy_s)
        else:
            if streamed is not None:  # e.g. a retried rollout task: train the batch as a whole
                streamed.abandon()
            metrics = self.trainer.train_step(batch)
        metrics.update(lag, objective=self.trainer.objective)  # the objective the trainer ran
        metrics["seconds"] = time.perf_counter() - started
        check_logprob_gap(step, metrics, lag, self.config.training.max_logprob_gap)
        return metrics

    def publish(self, step: int) -> dict:
        """Make policy version `step` available to the rollout instances (returns at once: the
        version is served from memory and uploaded in the background)."""
        if self.step != step:
            raise RuntimeError(f"the policy is at version {self.step}; cannot publish version {step}")
        started = time.perf_counter()
        if self.fabric is not None:
            self.fabric.publish(step, self.trainer.policy_state())
        return {"version": step, "seconds": time.perf_counter() - started}

    def account(self, step: int, tokens_trained: int) -> dict:
        """Record the step in the cost ledger (instances, their usage, the step, the weight pulls);
        returns its cost, the weight MiB the instances pulled, their fallbacks (whole versions
        instead of deltas, and payloads from other sources after a copy failed its check), how
        many pulls and the slowest one's seconds (None: no pull)."""
        instance_tokens, wasted = self._step_usage.pop(step, ({}, 0))
        with self._stops_when_redis_is_gone():
            traffic = self.accounting.end_step(step, tokens_trained, instance_tokens, wasted)
        return {
            "cost_usd": self.accounting.step_cost_usd(step) or 0.0,
            "weights_mb": traffic.nbytes / 2**20,
            "weight_fallbacks": traffic.full_fallbacks + traffic.source_fallbacks,
            "pulls": traffic.pulls,
            "pull_s": traffic.pull_s,
        }

    def cost_report(self) -> CostReport:
        """The run's cost report so far (instances still up are billed to now)."""
        return self.accounting.report()

    @contextmanager
    def _stops_when_redis_is_gone(self) -> Iterator[None]:
        """A Redis gone past the outage timeout stops the run with what it kept (`RunStopped`)."""
        try:
            yield
        except RedisUnreachable as error:
            checkpoint = latest_checkpoint(self.checkpoint_dir)
            step = int(checkpoint.name.removeprefix("step_")) if checkpoint is not None else None
            raise RunStopped(error, checkpoint, step) from None

    def _abandon_stream(self) -> None:
        """Drop a streamed step that was never trained (its rollout is being redone)."""
        if self._stream is not None:
            self._stream[1].abandon()
            self._stream = None

    def evaluate(self) -> float:
        """Held-out pass@k and avg@k of the current policy on the in-process engine (with an
        environment: of trajectories, each turn answered in process), drawn as the fabric draws an
        evaluation of this version (`rl.evaluation.evaluation_requests`: `rlboost eval` of the
        checkpoint gives the same figures); the record goes to `<run>/evals/` and
        `self.last_eval`, and avg@k (the mean accuracy) is returned. With the fabric that engine
        does nothing else, so one that holds its own weights (vLLM, or an HF copy in another dtype)
        is closed afterwards: between evaluations its memory is the trainer's (SmolLM2 on vLLM: 1.5
        GB, 0.9 GB of it returned), and the next evaluation builds it again."""
        started = time.perf_counter()
        estimates = evaluate_pass_at_k(
            self.engine,
            self.tokenizer,
            self.eval_records,
            self.config.eval,
            step=self.step,
            max_new_tokens=self.config.rollout.max_new_tokens,
            run_seed=self.config.run.seed,
            prompt=self.rollout_prompt,
            environment=EnvironmentFactory(self.environment.path, dict(self.environment.args))
            if self.environment
            else None,
            max_turns=self.environment.max_turns if self.environment else 1,
        )
        if self.fabric is not None and self._engine is not None and not self._engine_shares_model:
            self._engine.close()
            self._engine = None
        self.last_eval = EvalResult(
            run=self.config.run.name,
            step=self.step,
            where="in_process",
            pass_at_k=estimates.pass_at_k,
            avg_at_k=estimates.avg_at_k,
            problems=estimates.problems,
            samples=estimates.samples,
            temperature=self.config.eval.temperature,
            seconds=time.perf_counter() - started,
        )
        self.last_eval.write(self.directory)
        self.history.evals.append((self.step, estimates.avg_at_k))
        return estimates.avg_at_k

    def record(self, row: StepRecord) -> None:
        """Finish a step: its record becomes part of the run's history (and its metrics file)."""
        self.history.record(row)
        self.cursor += self.config.rollout.prompts_per_step
        self.paths(row.step).metrics.write_text(json.dumps(row.to_json()))

    def checkpoint(self) -> str:
        state = {
            "cursor": self.cursor,
            "history": self.history.state(),
        }
        if self.fabric is not None:
            with self._stops_when_redis_is_gone():
                state["offload"] = self.fabric.offload_state()
        return str(save_checkpoint(self.checkpoint_dir, self.trainer, state, keep=self.config.run.keep_checkpoints))

    def close(self) -> None:
        """Close what the session made, last made first; each part closes even if one before fails."""
        self._resources.close()


def trajectory_spec(config: RunConfig, tokenizer: Any) -> tuple[EnvironmentSpec | None, PromptConfig]:
    """The run's environment as the fabric enqueues it (each group fills in its problem) and the
    prompt configuration its rollout uses (the tool format's stop strings added); the tool format
    is made here, so a chat template that cannot carry tool calls is refused before any work."""
    if config.environment is None:
        return None, config.prompt
    factory = config.environment.load()
    stop = config.prompt.stop
    if factory.uses_tools:
        try:
            format = make_tool_format(config.prompt.chat_template, tokenizer)
        except ToolFormatError as error:
            raise ValueError(f"environment: the model at {config.model.path}: {error}") from None
        stop = (*stop, *(s for s in format.stop if s not in stop))
    spec = EnvironmentSpec(
        factory.path,
        prompt="",
        answer="",
        args=dict(factory.args),
        max_turns=config.environment.max_turns,
        step_timeout_s=config.environment.step_timeout_s,
        retries=config.environment.retries,
        chat_template=config.prompt.chat_template,
    )
    return spec, config.prompt.model_copy(update={"stop": stop})


def _parameters(model: Any) -> int | None:
    """The policy's parameter count (None: its trainer ranks hold it, not this process)."""
    return None if model is None else sum(p.numel() for p in model.parameters())


def _make_trainer(config: RunConfig, device: torch.device, pad_token_id: int) -> tuple[Any, PolicyTrainer]:
    """(model, trainer): the torch trainer owns the policy in this process; the DeepSpeed trainer's
    ranks own it (model None: this process holds no copy)."""
    model_config, trainer_config = config.model, config.trainer
    autocast = "bf16" if model_config.dtype == "bf16" else None
    grpo = config.grpo.model_copy(update={"objective": config.objective})  # `auto` resolved by the staleness
    if trainer_config.backend == "torch":
        model = load_policy(model_config.path, model_config.gguf_file).to(device)
        trainer = Trainer(
            model,
            pad_token_id,
            grpo,
            config.optim,
            temperature=config.rollout.temperature,
            autocast_dtype=torch.bfloat16 if autocast else None,
            gradient_checkpointing=trainer_config.gradient_checkpointing,
            lora=model_config.lora,
        )
        return trainer.model, trainer
    spec = TrainSpec(
        model_path=model_config.path,
        gguf_file=model_config.gguf_file,
        device=str(device),
        autocast=autocast,
        pad_token_id=pad_token_id,
        temperature=config.rollout.temperature,
        grpo=grpo,
        optim=config.optim,
        trainer=trainer_config,
        lora=model_config.lora,
    )
    trainer = DistributedTrainer(
        spec,
        config.run.directory / "trainer" / "ranks.log",
        state_dtype=model_config.dtype,
        rendezvous_id=config.run.name,  # what `rlboost trainer-node --run-id` names (trainer.nodes > 1)
    )
    return None, trainer


def version_lag(samples: list[Sample], trained_version: int, max_staleness: int) -> dict[str, Any]:
    """How many versions behind `trained_version` the samples' trained tokens were generated: mean,
    max and histogram (lag -> tokens); a trajectory's environment segments are of no version and
    never trained. Raises if a token breaks the staleness bound (the token log refuses such
    flushes, so this is the invariant's last check, not a policy)."""
    histogram: dict[int, int] = {}
    for sample in samples:
        for version, trained in zip(sample.versions(), sample.trained()):
            if trained:
                histogram[trained_version - version] = histogram.get(trained_version - version, 0) + 1
    tokens = sum(histogram.values())
    worst = max(histogram, default=0)
    if worst > max_staleness or min(histogram, default=0) < 0:
        raise RuntimeError(
            f"tokens of versions {sorted(trained_version - lag for lag in histogram)} reached the training of "
            f"version {trained_version}, outside training.max_staleness={max_staleness}"
        )
    return {
        "version_lag_mean": sum(lag * n for lag, n in histogram.items()) / max(tokens, 1),
        "version_lag_max": worst,
        "version_lag_histogram": {str(lag): n for lag, n in sorted(histogram.items())},
    }


class LogprobGapExceeded(RuntimeError):
    """The trainer's log-probs of the sampled tokens are far from the engines': they decoded other weights."""


def check_logprob_gap(step: int, metrics: dict, lag: dict, limit: float | None) -> None:
    """Fail the step when its mean trainer-vs-engine log-prob gap exceeds `limit`, naming the versions."""
    gap = metrics.get("rollout_logprob_gap")
    if limit is None or gap is None or gap <= limit:
        return
    versions = sorted(step - 1 - int(lag_) for lag_ in lag["version_lag_histogram"])
    raise LogprobGapExceeded(
        f"step {step}: the mean |trainer - engine| log-prob gap is {gap:.3f} per token, above "
        f"training.max_logprob_gap={limit:g}: the trainer holds version {step - 1} and the samples say they "
        f"were generated by versions {versions}; an engine decoded other weights (a version not delivered, "
        f"or a different dtype or model). Check the instance logs, or raise training.max_logprob_gap"
    )


_SESSIONS: dict[str, TrainingSession] = {}
_LOCK = threading.Lock()


def open_session(key: str, config: RunConfig) -> TrainingSession:
    """Create (or replace) the session registered under `key`."""
    session = TrainingSession(config)
    with _LOCK:
        _SESSIONS[key] = session
    return session


def get_session(key: str) -> TrainingSession:
    with _LOCK:
        if key not in _SESSIONS:
            raise KeyError(f"no training session {key!r} in this process (was rl-train started here?)")
        return _SESSIONS[key]


def close_session(key: str) -> None:
    with _LOCK:
        session = _SESSIONS.pop(key, None)
    if session is not None:
        session.close()
