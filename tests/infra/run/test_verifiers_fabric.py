"""A verifiers taskset (tests.rl.verifiers_calc, verifiers' own classes) through a fabric step of the
training session, on the tiny model that memorised its trajectories: undisturbed on a co-located
reserved instance, and on two spot instances of one trajectory each, the provider preempting one
(SIGKILL) while its trajectory waits inside the verifiers tool (at a gate). The trajectory continues
on another instance, which rebuilds its verifiers trace from the logged turns and runs the
unanswered call again; both end token for token as undisturbed: the tool results logged as masked
environment segments, the reward of the taskset's rubric. One preemption, one mid-turn migration,
one replacement instance."""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.run.config import load_config
from infra.run.session import TrainingSession
from rl.models import load_tokenizer
from rl.rollout import Sample, read_samples
from tests.helpers import RESERVED_POOL, spot_pool, tiny_run, wait_for
from tests.infra.rollout import agentic
from tests.infra.rollout.agentic import TWO_CALLS

pytestmark = pytest.mark.integration

TASKSET = "tests.rl.verifiers_calc:CalcTaskset"
REWARD = 1.0 + 0.25 * 2
"""The rubric's reward of the memorised trajectory: correct, and 0.25 per tool call."""
REAP_TIMEOUT_S = 10.0
"""Not the demo's 3 s: a worker importing verifiers on a loaded 2-core machine missed heartbeats for
3 s, and the reap of a live instance would add a migration."""
STEP_TIMEOUT_S = 300.0
"""A tool call at the gate waits for the other instance's to get there (its verifiers import, on a
loaded machine tens of seconds): not an environment timing out."""
PREEMPTED = "1/0/0"
"""The trajectory whose spot instance is preempted (each instance holds one)."""


@dataclass(frozen=True)
class Run:
    samples: list[Sample]
    rollout: dict
    """`TrainingSession.rollout`'s figures of the step."""
    instances: list[tuple[str, str | None]]
    """(pool, why it ended; None: running at the step's end) of each instance the fabric started."""


class GatePreempter(threading.Thread):
    """Preempts the spot instance of the session's fabric that holds `sample` (the provider's silent
    preemption, SIGKILL; a replacement starts) once every trajectory of the step waits inside its
    first verifiers tool call, its first turn logged; then opens the tool's gate."""

    def __init__(self, session: TrainingSession, sample: str, gate: Path, calls: Path) -> None:
        super().__init__(daemon=True)
        assert session.fabric is not None
        self.fabric, self.tokenizer, self.sample = session.fabric, session.tokenizer, sample
        self.gate, self.calls = gate, calls
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            wait_for(self._calling, "every trajectory inside the verifiers tool", timeout_s=240)
            live = [r.instance_id for r in self.fabric.provider.instances(live_only=True)]
            running = self.fabric.log.step_leases(1, live).running
            (holder,) = [i for i in live if any(lease.sample_id == self.sample for lease in running[i])]
            self.fabric.provider.terminate(holder, "preempted_silent")
            wait_for(lambda: self.fabric.provider.describe(holder).state == "terminated", "the preempted instance gone")
        except BaseException as error:  # the main thread raises it, after the step
            self.error = error
        finally:
            self.gate.touch()

    def _calling(self) -> bool:
        try:
            records = self.fabric.log.read_group(1, 0)
        except KeyError:  # the step is not enqueued yet
            return False
        first_turn = agentic.model_turns(TWO_CALLS)[0]
        logged = all(r.turns == () and self.tokenizer.decode(r.token_ids) == first_turn for r in records)
        return logged and self.calls.exists() and self.calls.read_text().count("waiting 12+345") == len(records)


@pytest.fixture(scope="module")
def memorised(tmp_path_factory) -> Path:
    return agentic.memorised_model(tmp_path_factory.mktemp("verifiers-model") / "model")


@pytest.fixture(scope="module")
def runs(memorised, tmp_path_factory) -> dict[str, Run]:
    """Step 1 of two sessions of the same run configuration: undisturbed on a co-located reserved
    instance, and on two spot instances of one trajectory each (they start while the undisturbed step
    runs), the one holding trajectory 1/0/0 preempted inside its tool call."""
    from rl.environments.verifiers_env import write_tasks  # verifiers' import takes seconds

    root = tmp_path_factory.mktemp("verifiers-fabric")
    write_tasks(TASKSET, root / "all.jsonl")
    rows = [json.loads(line) for line in (root / "all.jsonl").read_text().splitlines()]
    (root / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["prompt"] == TWO_CALLS[0]))
    gate, calls = root / "gate", root / "calls.txt"

    def session(name: str, pool: dict, config: dict, slots: int = 64) -> TrainingSession:
        overrides = {
            "data.source": "file",
            "data.path": str(root / "tasks.jsonl"),
            "data.eval_path": str(root / "tasks.jsonl"),
            "environment": {
                "name": "verifiers",
                "args": {"taskset": TASKSET, "config": config},
                "max_turns": 4,
                "step_timeout_s": STEP_TIMEOUT_S,
            },
            "fabric.pools": [pool],
            "fabric.worker.slots": slots,
            "fabric.controller.reap_timeout_s": REAP_TIMEOUT_S,
            "rollout.max_new_tokens": 400,
            "rollout.prompts_per_step": 1,
            "rollout.group_size": 2,
            "eval.size": 1,
            "ledger.url": f"sqlite:///{root / f'{name}.sqlite'}",
        }
        return TrainingSession(load_config(None, tiny_run(memorised, root, name, None, overrides)))

    def step(session: TrainingSession) -> Run:
        assert session.fabric is not None
        rollout = session.rollout(1)
        instances = [(r.pool, r.reason) for r in session.fabric.provider.instances()]
        return Run(read_samples(Path(rollout["path"])), rollout, instances)

    preempted = session("preempted", spot_pool(2), {"task": {"gate": str(gate), "calls": str(calls)}}, slots=1)
    try:
        undisturbed = session("undisturbed", {**RESERVED_POOL, "colocated": True}, {})
        try:
            reference = step(undisturbed)
        finally:
            undisturbed.close()
        preempter = GatePreempter(preempted, PREEMPTED, gate, calls)
        preempter.start()
        run = step(preempted)
        preempter.join()
        if preempter.error is not None:
            raise preempter.error
        lines = calls.read_text().splitlines()
        assert lines.count("called 12+345") == lines.count("called 357+67+89") == 2
        assert lines.count("waiting 12+345") == 3  # the preempted call, run again once on another instance
    except BaseException:
        for log in sorted((root / "runs" / "preempted" / "instances").glob("*.log")):
            print(f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        preempted.close()
    return {"undisturbed": reference, "preempted": run}


def _masked_spans(sample: Sample) -> list[tuple[int, int]]:
    """(start, end) of each run of masked (environment) tokens."""
    spans, start = [], None
    for i, bit in enumerate([*sample.trained(), 1]):
        if bit == 0 and start is None:
            start = i
        elif bit and start is not None:
            spans.append((start, i))
            start = None
    return spans


@pytest.mark.parametrize("name", ["undisturbed", "preempted"])
def test_verifiers_trajectories_end_with_the_rubrics_reward_and_only_the_tool_results_masked(memorised, runs, name):
    tokenizer = load_tokenizer(memorised)
    results = [tokenizer.encode(agentic.FORMAT.render(r), add_special_tokens=False) for r in TWO_CALLS[3]]
    samples = runs[name].samples
    assert [s.sample_id for s in samples] == ["1/0/0", "1/0/1"]
    for sample in samples:
        assert tokenizer.decode(sample.response_ids, skip_special_tokens=True) == agentic.transcript(TWO_CALLS)
        assert [observation for _, observation in sample.turns] == list(TWO_CALLS[3])
        assert [sample.response_ids[start:end] for start, end in _masked_spans(sample)] == results
        assert sample.env_reward == REWARD and not sample.truncated


def test_the_preempted_trajectories_end_token_for_token_as_the_undisturbed_ones(runs):
    undisturbed, preempted = runs["undisturbed"], runs["preempted"]
    for want, got in zip(undisturbed.samples, preempted.samples, strict=True):
        assert got.response_ids == want.response_ids and got.turns == want.turns
        assert got.trained() == want.trained() and got.versions() == want.versions()
        assert want.migrated_mid_turn == 0  # claimed again inside its tool call:
        assert got.migrated_mid_turn == (1 if got.sample_id == PREEMPTED else 0)
    counts = ("preemptions", "reaped_instances", "migrations", "migrated_mid_turn", "infra_failed")
    assert {k: undisturbed.rollout[k] for k in counts} == dict.fromkeys(counts[:-1], 0) | {"infra_failed": {}}
    assert {k: preempted.rollout[k] for k in counts} == {
        "preemptions": 1,
        "reaped_instances": 1,
        "migrations": 1,
        "migrated_mid_turn": 1,
        "infra_failed": {},
    }
    assert undisturbed.instances == [("reserved", None)]
    assert Counter(preempted.instances) == {("spot", "preempted_silent"): 1, ("spot", None): 2}  # its replacement
