"""pass@k of a checkpoint through the rollout fabric equals pass@k of the same checkpoint in process,
though one of the fabric's two spot instances is preempted (SIGKILL) while it holds samples with
logged tokens: those samples continue on the other from their logged tokens (mid-sample
migrations), and the keyed sampler draws each evaluation sample by its id, wherever it runs. The
fabric's instances are billed as eval $."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from infra.ledger.recorder import Ledger
from infra.run.config import load_config
from infra.run.eval_result import EvalResult
from infra.run.evaluation import evaluate_checkpoint
from infra.run.fabric import RolloutFabric
from rl.checkpoint import save_checkpoint
from rl.config import GRPOConfig, OptimConfig
from rl.models import load_model
from tests.helpers import run_trainer, spot_pool, tiny_run, wait_for

pytestmark = pytest.mark.integration

STEP = 3
PROBLEMS, SAMPLES = 8, 8
SPOT = 2
"""Spot worker processes (they start together): one is preempted, the other finishes its samples."""
SLOTS = 2
"""Samples an instance generates at once: with 16, one instance could take all 64 samples and finish
them in 0.35 s, before the `Preempter` (polling every 5 ms from a loaded test process) saw a sample
with logged tokens (a CI run, 2026-12-06); with 2, an instance is inside samples with logged tokens
for nearly all of its rollout."""


def checkpoint_of(model_dir, run_dir, step: int = STEP):
    """A checkpoint of the model in `model_dir` as a run's step `step`."""
    model, tokenizer = load_model(model_dir)
    trainer = run_trainer(model, tokenizer.pad_token_id, GRPOConfig(), OptimConfig())
    trainer.step = step
    return save_checkpoint(run_dir / "checkpoints", trainer, {"cursor": 0})


class Preempter(threading.Thread):
    """Preempts (SIGKILL, the provider's silent preemption: a replacement starts) the first spot
    instance of `fabric` that holds a sample of `step` with logged tokens, and keeps the ids of the
    samples it held with tokens then: each can only end on another instance, from its tokens."""

    def __init__(self, fabric: RolloutFabric, step: int) -> None:
        super().__init__(daemon=True)
        self.fabric, self.step = fabric, step
        self.held: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and not self.held:
            live = [r.instance_id for r in self.fabric.provider.instances(live_only=True)]
            running = self.fabric.log.step_leases(self.step, live).running if live else {}
            for instance, leases in running.items():
                if any(lease.logged > 0 for lease in leases):
                    self.fabric.provider.terminate(instance, "preempted_silent")
                    leases = self.fabric.log.step_leases(self.step, [instance]).running[instance]
                    self.held = [lease.sample_id for lease in leases if lease.logged > 0]
                    break
            self.stop.wait(0.005)


@contextmanager
def preempted(fabric: RolloutFabric, caught: list[Preempter]) -> Iterator[None]:
    """The evaluation's rollout once every spot instance registered, one preempted inside samples."""
    wait_for(lambda: len(fabric.registry.alive()) == SPOT, "the spot instances registered", timeout_s=120)
    preempter = Preempter(fabric, STEP)
    caught.append(preempter)
    preempter.start()
    try:
        yield
    finally:
        preempter.stop.set()
        preempter.join()
    records = [r for group in range(PROBLEMS) for r in fabric.log.read_group(STEP, group)]
    preempter.held = [r.sample_id for r in records if r.sample_id in preempter.held and r.migrations >= 1]


def test_pass_at_k_on_the_fabric_with_a_preemption_mid_sample_equals_in_process(pretrained_tiny_model, tmp_path):
    overrides = tiny_run(
        pretrained_tiny_model,
        tmp_path,
        "eval-fabric",
        None,
        {
            "eval.size": PROBLEMS,
            "eval.samples": SAMPLES,
            "eval.k": [1, 4, 8],
            "fabric.pools": [spot_pool(SPOT)],  # no Poisson schedule: the `Preempter` preempts one
            "fabric.worker": {"slots": SLOTS, "flush_tokens": 1, "flush_ms": 20, "heartbeat_s": 0.3, "ttl_s": 1.5},
            "fabric.controller": {"reap_timeout_s": 1.5},
        },
    )
    config = load_config(None, overrides)
    checkpoint = checkpoint_of(pretrained_tiny_model, config.run.directory)

    local = evaluate_checkpoint(config, checkpoint, fabric=False)
    caught: list[Preempter] = []
    remote = evaluate_checkpoint(config, checkpoint, fabric=True, during=lambda fabric: preempted(fabric, caught))

    (preempter,) = caught
    print(
        f"in process {local.line()} {local.seconds:.1f} s; fabric {remote.line()} {remote.seconds:.1f} s, "
        f"{remote.preemptions} preemptions, {remote.migrations} migrations, {len(preempter.held)} mid-sample"
    )
    assert (local.step, remote.step) == (STEP, STEP)
    assert local.samples == remote.samples == PROBLEMS * SAMPLES
    assert 0 < local.pass_at_k[1] < local.pass_at_k[8] <= 1  # the pretrained model is right some of the time
    assert remote.pass_at_k == local.pass_at_k and remote.avg_at_k == local.avg_at_k
    assert remote.preemptions == 1 and preempter.held, "samples with logged tokens continued on the replacement"
    assert remote.migrations >= len(preempter.held)
    assert remote.ledger_run_id is not None
    with Ledger() as ledger:  # the evaluation's instances, billed as its own run's one step
        report = ledger.report(remote.ledger_run_id)
    assert [s.step for s in report.steps] == [STEP] and report.total_usd > 0
    assert remote.cost_usd == pytest.approx(report.total_usd)
    written = sorted(p.name for p in (config.run.directory / "evals").glob("*.json"))
    assert written == [f"step_{STEP:06d}.fabric.json", f"step_{STEP:06d}.in_process.json"]
    again = EvalResult.model_validate_json((config.run.directory / "evals" / written[0]).read_text())
    assert again.pass_at_k == remote.pass_at_k
