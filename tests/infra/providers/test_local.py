"""Local pools: real process groups preempted with real signals on a scripted capacity schedule.

Children run `tests.fakes.local_instance`, which reports through files in a temporary directory:
`<id>.ready` once their SIGTERM disposition is set, `<id>.pid`, `<id>.term` from the SIGTERM
handler, `<id>.grandchild` (the pid of a child of their own that ignores SIGTERM). The lifecycle
tests run twice: the instances started fresh, and forked from a fork template (`warm`).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from infra.availability.traces import AvailabilityTrace, TraceEvent, TraceSchedule
from infra.providers import LocalProvider, PoissonAvailability, PoolSpec, TraceAvailability
from infra.providers.local import MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S, START_WINDOW_S
from infra.providers.warm_start import WarmStart
from rl.warm_fork.client import retire_templates
from tests.helpers import Clock, parent_pid, process_state, wait_for

WARM = WarmStart(pools=frozenset({"spot", "trainer", "flaky", "steady"}), preload=("json",))
"""The pools of these tests, forked from a template that imports next to nothing first."""


def factory(out: Path, mode: str) -> Callable[[PoolSpec, str], list[str]]:
    return lambda pool, instance_id: [sys.executable, "-m", "tests.fakes.local_instance", str(out), mode]


@pytest.fixture(params=["fresh", "forked"])
def warm(request: pytest.FixtureRequest) -> WarmStart | None:
    """Each lifecycle test twice: instances started as new interpreters, and forked from a template."""
    return WARM if request.param == "forked" else None


def spot(size: int = 3, **overrides: object) -> PoolSpec:
    fields: dict[str, object] = {
        "name": "spot",
        "capacity_class": "spot",
        "size": size,
        "machine_type": "g2-standard-8",
        "price_per_hour": 0.28,
        "notice_s": 5.0,
    }
    return PoolSpec.model_validate(fields | overrides)


def scripted(slots: int, events: tuple[TraceEvent, ...]) -> TraceSchedule:
    """Trace seconds at 10x: an event at trace t=10 happens 1 s (wall) after the pool starts."""
    trace = AvailabilityTrace("scripted", slots, slots, events, 30.0)
    return TraceSchedule(trace, slots, time_compression=10.0, loop=False)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its new parent, is dead too)."""
    return process_state(pid) not in (None, "Z")


def pid_of(out: Path, instance_id: str, kind: str = "pid") -> int:
    return int((out / f"{instance_id}.{kind}").read_text())


def wait_ready(out: Path, ids: list[str]) -> None:
    wait_for(lambda: all((out / f"{i}.ready").exists() for i in ids), f"{ids} ready")


def wait_terminated(provider: LocalProvider, ids: list[str]) -> None:
    def done() -> bool:
        provider.tick()
        return all(provider.describe(i).state == "terminated" for i in ids)

    wait_for(done, f"{ids} terminated")


@pytest.mark.integration
def test_capacity_drop_preempts_with_notice_and_return_relaunches(tmp_path, warm):
    clock = Clock(0.0)
    schedule = scripted(3, (TraceEvent(10.0, -2), TraceEvent(20.0, 2)))
    with LocalProvider(
        factory(tmp_path, "trap"), schedules={"spot": schedule}, clock=clock, warm_start=warm
    ) as provider:
        handles = provider.launch(spot(), 3)
        ids = [h.instance_id for h in handles]
        assert ids == ["spot-0", "spot-1", "spot-2"]
        wait_ready(tmp_path, ids)
        assert (tmp_path / "spot-0.ready").read_text() == "spot"  # RLBOOST_CAPACITY_CLASS
        pids = [pid_of(tmp_path, i) for i in ids]

        clock.t = 1.0  # capacity 3 -> 1
        provider.tick()
        events = provider.preemptions()
        assert len(events) == 2 and not any(e.silent for e in events)
        assert all(e.at == 1.0 and e.kill_at == 1.5 for e in events)  # notice 5 s / compression 10
        preempted = sorted(e.instance_id for e in events)
        wait_terminated(provider, preempted)
        for instance_id in preempted:
            record = provider.describe(instance_id)
            assert (record.reason, record.exit_code, record.notice_at) == ("preempted", 0, 1.0)
            assert (tmp_path / f"{instance_id}.term").read_text() == "spot"  # the SIGTERM handler ran
        assert len(provider.instances(live_only=True)) == 1

        clock.t = 2.0  # capacity back to 3
        provider.tick()
        live = provider.instances(live_only=True)
        assert sorted(r.instance_id for r in live) == sorted({*ids} - {*preempted} | {"spot-3", "spot-4"})
        assert provider.preemptions() == []
        wait_ready(tmp_path, ["spot-3", "spot-4"])
        pids += [pid_of(tmp_path, "spot-3"), pid_of(tmp_path, "spot-4")]

    records = provider.instances()
    assert len(records) == 5 and all(r.state == "terminated" for r in records)
    assert sorted(r.reason or "" for r in records) == ["preempted", "preempted"] + ["scaled_down"] * 3
    assert all(r.launched_at <= (r.terminated_at or 0) and r.price_per_hour == 0.28 for r in records)
    assert not any(alive(pid) for pid in pids)


@pytest.mark.integration
def test_sigterm_ignored_means_sigkill_after_the_notice(tmp_path, warm):
    clock = Clock(0.0)
    schedule = scripted(1, (TraceEvent(10.0, -1),))
    with LocalProvider(
        factory(tmp_path, "ignore"), schedules={"spot": schedule}, clock=clock, warm_start=warm
    ) as provider:
        [handle] = provider.launch(spot(size=1), 1)
        wait_ready(tmp_path, [handle.instance_id])
        pid = pid_of(tmp_path, handle.instance_id)
        clock.t = 1.0
        provider.tick()  # SIGTERM, ignored
        clock.t = 1.4
        time.sleep(0.3)
        provider.tick()  # within the 0.5 s notice: still alive
        assert provider.describe(handle.instance_id).state == "terminating" and alive(pid)
        clock.t = 1.5
        wait_terminated(provider, [handle.instance_id])  # the first tick at 1.5 sends SIGKILL
        record = provider.describe(handle.instance_id)
        assert (record.reason, record.exit_code) == ("preempted", -9)
        assert not (tmp_path / f"{handle.instance_id}.term").exists() and not alive(pid)
        clock.t = 2.5
        provider.tick()
        assert provider.instances(live_only=True) == []  # capacity stays 0 (no loop)


@pytest.mark.integration
def test_silent_kill_gives_no_notice(tmp_path, warm):
    clock = Clock(0.0)
    schedule = scripted(2, (TraceEvent(10.0, -2),))
    pool = spot(size=2, silent_kill_fraction=1.0)
    with LocalProvider(
        factory(tmp_path, "trap"), schedules={"spot": schedule}, clock=clock, warm_start=warm
    ) as provider:
        ids = [h.instance_id for h in provider.launch(pool, 2)]
        wait_ready(tmp_path, ids)
        clock.t = 1.0
        provider.tick()
        events = provider.preemptions()
        assert all(e.silent and e.kill_at == e.at == 1.0 for e in events) and len(events) == 2
        wait_terminated(provider, ids)
        for instance_id in ids:
            record = provider.describe(instance_id)
            assert (record.reason, record.exit_code) == ("preempted_silent", -9)
            assert not (tmp_path / f"{instance_id}.term").exists()


@pytest.mark.integration
def test_scale_down_uses_sigterm_lowers_the_target_and_sweeps_the_group(tmp_path, warm):
    reserved = spot(name="trainer", capacity_class="reserved", size=2)
    with LocalProvider(factory(tmp_path, "family"), warm_start=warm) as provider:
        ids = [h.instance_id for h in provider.launch(reserved, 2)]
        wait_ready(tmp_path, ids)
        grandchildren = [pid_of(tmp_path, i, "grandchild") for i in ids]
        provider.terminate("trainer-0")
        assert provider.preemptions() == []  # a scale-down is not a preemption
        wait_terminated(provider, ["trainer-0"])
        record = provider.describe("trainer-0")
        assert (record.reason, record.exit_code) == ("scaled_down", 0)
        assert (tmp_path / "trainer-0.term").exists()
        # The grandchild ignored SIGTERM; the group sweep after its leader exited killed it.
        wait_for(lambda: not alive(grandchildren[0]), "the grandchild swept")
        provider.tick()
        assert [r.instance_id for r in provider.instances(live_only=True)] == ["trainer-1"]  # no replacement
        provider.terminate("trainer-0")  # already gone: a no-op
        with pytest.raises(KeyError, match="trainer-7"):
            provider.terminate("trainer-7")
        with pytest.raises(ValueError, match="exceeds size"):
            provider.launch(reserved, 2)
        assert provider.quote(reserved) == 0.28
    wait_for(lambda: not any(alive(pid) for pid in grandchildren), "every grandchild gone after shutdown")


@pytest.mark.integration
def test_failed_starts_back_off_doubling_up_to_a_cap_and_their_log_says_why(tmp_path, warm):
    pool = spot(name="flaky", capacity_class="ondemand", size=1)
    clock = Clock()
    logs = tmp_path / "logs"
    with LocalProvider(factory(tmp_path, "exit3"), clock=clock, log_dir=logs, warm_start=warm) as provider:
        provider.launch(pool, 1)
        waits = []
        for attempt in range(7):
            instance = f"flaky-{attempt}"
            wait_terminated(provider, [instance])
            record = provider.describe(instance)
            assert (record.reason, record.exit_code) == ("crashed", 3)
            # no relaunch before the back-off has passed, then one
            assert len(provider.instances()) == attempt + 1
            wait = min(RESTART_BACKOFF_S * 2**attempt, MAX_RESTART_BACKOFF_S)
            clock.advance(wait * 0.99)
            provider.tick()
            assert len(provider.instances()) == attempt + 1
            clock.advance(wait * 0.02)
            provider.tick()
            assert len(provider.instances()) == attempt + 2
            waits.append(wait)
        assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
        # the pool never gives up by itself (the run's instance watch does); the log says why
        assert provider.last_log_line("flaky-6") == f"boom: cannot load the model (its log: {logs / 'flaky-6.log'})"
    assert LocalProvider(factory(tmp_path, "exit3")).last_log_line("flaky-0") == ""  # no log directory


@pytest.mark.integration
def test_a_failed_instance_is_killed_at_once_and_replaced_without_a_preemption(tmp_path, warm):
    pool = spot(name="steady", capacity_class="ondemand", size=1)
    with LocalProvider(factory(tmp_path, "ignore"), warm_start=warm) as provider:  # it would ignore a SIGTERM
        provider.launch(pool, 1)
        wait_ready(tmp_path, ["steady-0"])
        provider.terminate("steady-0", "crashed")
        wait_terminated(provider, ["steady-0"])
        record = provider.describe("steady-0")
        assert (record.reason, record.exit_code) == ("crashed", -9)
        assert provider.preemptions() == []

        def replaced() -> bool:  # after the failed start's back-off (1 s), if it was reaped before a tick saw it go
            provider.tick()
            return any(r.instance_id == "steady-1" and r.state == "running" for r in provider.instances())

        wait_for(replaced, "its replacement")


@pytest.mark.integration
def test_an_instance_that_crashes_after_it_started_is_replaced_without_a_back_off(tmp_path, warm):
    pool = spot(name="steady", capacity_class="ondemand", size=1)
    clock = Clock()
    with LocalProvider(factory(tmp_path, "trap"), clock=clock, warm_start=warm) as provider:
        provider.launch(pool, 1)
        wait_ready(tmp_path, ["steady-0"])
        clock.advance(START_WINDOW_S + 1)
        provider.tick()
        os.kill(pid_of(tmp_path, "steady-0"), 9)  # dies after it started: a crash, not a failed start
        wait_terminated(provider, ["steady-0"])
        assert provider.describe("steady-0").reason == "crashed"
        assert provider.describe("steady-1").state == "running"  # replaced at once, no back-off


@pytest.mark.integration
def test_dropped_provider_kills_its_groups(tmp_path, warm):
    provider = LocalProvider(factory(tmp_path, "ignore"), warm_start=warm)
    provider.launch(spot(capacity_class="ondemand", size=2), 2)
    wait_ready(tmp_path, ["spot-0", "spot-1"])
    pids = [pid_of(tmp_path, "spot-0"), pid_of(tmp_path, "spot-1")]
    del provider
    gc.collect()
    assert not any(alive(pid) for pid in pids)


@pytest.mark.integration
def test_helper_thread_replays_the_schedule_in_real_time(tmp_path):
    schedule = scripted(3, (TraceEvent(10.0, -2), TraceEvent(20.0, 2)))
    provider = LocalProvider(factory(tmp_path, "trap"), schedules={"spot": schedule})
    try:
        # a 3 s notice (30 s of trace time): a loaded machine may not run a child's SIGTERM handler
        # (it writes `.term`) within a shorter one, and the SIGKILL after it would leave no `.term`
        provider.launch(spot(notice_s=30.0), 3)
        wait_ready(tmp_path, ["spot-0", "spot-1", "spot-2"])  # handlers set before the drop at 1 s
        provider.start(interval_s=0.05)
        wait_for(  # two SIGTERMed children and two new ones: slow on an overloaded machine (load 16 took > 60 s)
            lambda: len(provider.instances()) == 5 and len(provider.instances(live_only=True)) == 3,
            "drop and return",
            timeout_s=180,
        )
    finally:
        provider.shutdown()
    records = provider.instances()
    assert [r.reason for r in records].count("preempted") == 2
    assert all((tmp_path / f"{r.instance_id}.term").exists() for r in records if r.reason == "preempted")
    pids = [pid_of(tmp_path, r.instance_id) for r in records if (tmp_path / f"{r.instance_id}.pid").exists()]
    assert pids and not any(alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="shut down"):
        provider.launch(spot(notice_s=30.0), 1)


# -- pool specs ---------------------------------------------------------------------------------


def test_pool_spec_validation_and_documentation():
    with pytest.raises(ValidationError, match="extra_forbidden"):
        spot(zone="us-central1-a")
    with pytest.raises(ValidationError, match="never preempted"):
        spot(capacity_class="reserved", availability={"poisson": {"mean_life_s": 60, "mean_gap_s": 10}})
    with pytest.raises(ValidationError):
        spot(silent_kill_fraction=1.5)
    assert "SIGTERM" in (PoolSpec.model_fields["notice_s"].description or "")
    assert all(field.description for field in PoolSpec.model_fields.values())

    pool = spot(availability={"poisson": {"mean_life_s": 600, "mean_gap_s": 60, "seed": 1}, "time_compression": 60})
    assert isinstance(pool.availability, PoissonAvailability)
    schedule = pool.schedule()
    assert schedule is not None and schedule.time_compression == 60
    assert {schedule.capacity_at(t) for t in range(0, 600, 5)} <= {0, 1, 2, 3}
    assert spot().schedule() is None


def test_pool_spec_trace_availability():
    pool = spot(availability={"trace": "bamboo/g4dn", "time_compression": 1440, "offset_s": 600})
    assert isinstance(pool.availability, TraceAvailability)
    schedule = pool.schedule()
    assert schedule is not None
    assert schedule.capacity_at(0.0) == 3  # 21 of 24 g4dn nodes at 10 min -> round(2.6) of 3
    # The 10.8 h trace replays in 27 s (wall) and visits every capacity of the pool.
    assert {schedule.capacity_at(t / 10) for t in range(265)} == {0, 1, 2, 3}
    assert any(change.delta < 0 for change in schedule.events_between(0.0, 26.5))


def test_a_cloud_pool_is_refused(tmp_path):
    provider = LocalProvider(factory(tmp_path, "sleep"), log_dir=tmp_path)
    cloud = spot(
        provider="gcp",
        gcp={"project": "my-rl-project", "zones": ["us-central1-a"], "image": "projects/x/global/images/y"},
    )
    try:
        with pytest.raises(ValueError, match="pool spot: provider 'gcp' is not local"):
            provider.launch(cloud, 1)
        assert provider.instances() == []
    finally:
        provider.shutdown()


FULL_LOG_DISK = """
import sys
from pathlib import Path
from infra.providers import LocalProvider

logs = Path(sys.argv[1]) / "logs"
logs.mkdir()
(logs / "flaky-4.log").write_bytes(b"")  # the instance could not even write its first line
try:
    with open(Path(sys.argv[1]) / "filler", "wb") as filler:
        while True:
            filler.write(b"x" * 4096)
            filler.flush()
except OSError:
    pass
with LocalProvider(lambda spec, instance_id: [sys.executable, "-c", "pass"], log_dir=logs) as provider:
    print(provider.last_log_line("flaky-4"))
"""


@pytest.mark.integration
def test_the_start_failure_of_an_instance_whose_log_disk_is_full_says_so(tmp_path):
    """Its log is empty (nothing could be written): the message names the full disk instead."""
    import subprocess

    from tests.helpers import on_a_small_disk

    disk = tmp_path / "disk"
    done = subprocess.run(
        on_a_small_disk(disk, "256k", [sys.executable, "-c", FULL_LOG_DISK, str(disk)]),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[3],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = disk / "logs" / "flaky-4.log"
    full = f"its disk is full: 0 B free of 256.0 kB on the file system of {disk / 'logs'}"
    assert done.stdout.strip() == f"its log is empty (its log: {log}; {full})"


@pytest.mark.integration
def test_a_forked_instance_runs_as_a_fresh_one_would(tmp_path):
    """The same command, environment and streams, its own session, and a parent of its own (the
    template): a fresh start and a forked one report the same process, and both write their log."""
    logs = {"fresh": tmp_path / "fresh-logs", "forked": tmp_path / "forked-logs"}
    seen = {}
    for start, warm in (("fresh", None), ("forked", WARM)):
        out = tmp_path / start
        out.mkdir()
        with LocalProvider(factory(out, "trap"), log_dir=logs[start], warm_start=warm) as provider:
            provider.launch(spot(size=1), 1)
            wait_ready(out, ["spot-0"])
            pid = pid_of(out, "spot-0")
            parent = parent_pid(pid)
            reported = (out / "spot-0.process.json").read_text().replace(str(out), "OUT")
            seen[start] = (json.loads(reported), parent)
    fresh, forked = seen["fresh"][0], seen["forked"][0]
    assert forked == fresh
    assert fresh["session_leader"] and fresh["stdin"] == "/dev/null" and fresh["main"] == "tests.fakes.local_instance"
    assert fresh["orig_argv"] == factory(Path("OUT"), "trap")(spot(), "spot-0")
    instance = {"RLBOOST_INSTANCE_ID": "spot-0", "RLBOOST_POOL": "spot", "RLBOOST_CAPACITY_CLASS": "spot"}
    assert fresh["environment"] == os.environ | instance | {"RLBOOST_DRIVER_PID": str(os.getpid())}
    assert seen["fresh"][1] == os.getpid() and seen["forked"][1] != os.getpid()  # forked: the template's child
    assert (logs["fresh"] / "spot-0.log").exists() and (logs["forked"] / "spot-0.log").exists()


def parent_of(out: Path, instance_id: str) -> int:
    return parent_pid(pid_of(out, instance_id))


@pytest.mark.integration
def test_providers_of_one_process_share_its_template_and_each_gives_its_run_to_its_instances(tmp_path, monkeypatch):
    """A second provider of this process (a second run) forks from the template the first started,
    though its run's environment (a Redis URL, a secret) differs: that reaches each instance as it
    forks. The template's log is its first owner's. Another `PYTHONPATH` gets a template of its own,
    which retires the one before (it had no instance left)."""
    monkeypatch.setenv("TEMPLATE_TEST_SETTING", str(tmp_path))  # a template of this test's own to begin with
    parents, environments = {}, {}
    for run, path in (("first", None), ("second", None), ("other-path", str(tmp_path))):
        out, logs = tmp_path / run, tmp_path / f"{run}-logs"
        out.mkdir()
        environment = {"RLBOOST_REDIS_URL": f"redis://{run}", "RUN_SECRET": run} | (
            {"PYTHONPATH": path} if path else {}
        )
        with LocalProvider(factory(out, "trap"), log_dir=logs, environment=environment, warm_start=WARM) as provider:
            provider.launch(spot(size=1), 1)
            wait_ready(out, ["spot-0"])
            parents[run] = parent_of(out, "spot-0")
            environments[run] = json.loads((out / "spot-0.process.json").read_text())["environment"]
    assert parents["first"] == parents["second"] != parents["other-path"]
    assert os.getpid() not in parents.values()
    assert not alive(parents["first"]) and alive(parents["other-path"])  # the new template retired the one before
    retire_templates()
    assert not alive(parents["other-path"])  # it had no instance left: it ended at once
    assert (tmp_path / "first-logs" / "fork-template.log").exists()
    assert not (tmp_path / "second-logs" / "fork-template.log").exists()
    assert (tmp_path / "other-path-logs" / "fork-template.log").exists()
    for run, environment in environments.items():
        assert (environment["RLBOOST_REDIS_URL"], environment["RUN_SECRET"]) == (f"redis://{run}", run)


@pytest.mark.integration
def test_a_changed_environment_gets_a_new_template_and_a_failed_template_fresh_starts(tmp_path, monkeypatch, caplog):
    with LocalProvider(factory(tmp_path, "trap"), warm_start=WARM) as provider:
        provider.launch(spot(size=3), 2)
        wait_ready(tmp_path, ["spot-0", "spot-1"])
        template = parent_of(tmp_path, "spot-0")
        assert parent_of(tmp_path, "spot-1") == template != os.getpid()
        monkeypatch.setenv("TEMPLATE_TEST_SETTING", "changed")  # what a new interpreter would read at start
        provider.launch(spot(size=3), 1)
        wait_ready(tmp_path, ["spot-2"])
        assert parent_of(tmp_path, "spot-2") not in (template, os.getpid())
        environment = json.loads((tmp_path / "spot-2.process.json").read_text())["environment"]
        assert (environment["RLBOOST_INSTANCE_ID"], environment["TEMPLATE_TEST_SETTING"]) == ("spot-2", "changed")
        assert alive(template)  # retired, it forks no more, but reaps the instances it forked
    assert not alive(template)  # once they are reaped, it ends
    broken = WarmStart(pools=WARM.pools, preload=("no_such_module_anywhere",))
    with LocalProvider(factory(tmp_path, "trap"), warm_start=broken, log_dir=tmp_path / "logs") as provider:
        provider.launch(spot(size=1, name="steady"), 1)
        wait_ready(tmp_path, ["steady-0"])
        assert parent_of(tmp_path, "steady-0") == os.getpid()  # started fresh
    assert "No module named 'no_such_module_anywhere'" in (tmp_path / "logs" / "fork-template.log").read_text()
    assert "processes start fresh from now on" in caplog.text


SLOW_IMPORT = """
import os, pathlib, time
pathlib.Path(os.environ["IMPORT_BEGAN"]).write_text(str(os.getpid()))
time.sleep(600)
"""
"""A module that takes ten minutes to import; it writes its process's pid when it begins."""

OWNER = """
import os, time
from rl.warm_fork.client import ForkTemplate
template = ForkTemplate(["slow_to_import"], dict(os.environ), None)
time.sleep(600)
"""
"""A template's owner that starts one preloading `slow_to_import`, then waits to be killed."""


@pytest.mark.integration
def test_a_template_whose_owner_is_killed_while_it_imports_exits_then(tmp_path):
    """The owner of a template still importing its modules is SIGKILLed: the template exits then,
    not once its imports are done (it would have outlived a killed driver by minutes)."""
    (tmp_path / "slow_to_import.py").write_text(textwrap.dedent(SLOW_IMPORT))
    began = tmp_path / "import-began"
    repo = Path(__file__).parents[3]
    env = os.environ | {"PYTHONPATH": f"{tmp_path}:{repo}", "IMPORT_BEGAN": str(began)}
    with (tmp_path / "owner.log").open("wb") as log:
        owner = subprocess.Popen([sys.executable, "-c", OWNER], env=env, cwd=repo, stdout=log, stderr=log)
    template = None
    try:
        wait_for(began.exists, "the template to begin importing")
        wait_for(lambda: began.read_text(), "the template's pid")
        template = int(began.read_text())
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        wait_for(lambda: not alive(template), "the template to exit after its owner was killed")
    finally:
        owner.kill()
        owner.wait()
        if template is not None and alive(template):
            os.kill(template, signal.SIGKILL)
