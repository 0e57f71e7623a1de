"""Preemption watchers against local endpoints that speak the GCE metadata and Azure Scheduled
Events protocols; the supervisor with real processes and signals; the rendered boot script run
with stand-in `python3`, `pip` and `prefect` executables."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from infra.watchers import AzureScheduledEventsWatcher, GcePreemptionWatcher, PreemptionNotice, supervise
from infra.watchers.supervisor import process_tree
from tests.fakes.metadata import FakeGceMetadata, FakeScheduledEvents
from tests.fakes.support import serving
from tests.helpers import REPO_ROOT, wait_for

pytestmark = pytest.mark.integration  # real processes

REPO = REPO_ROOT

WORKER = r"""
import os, pathlib, signal, subprocess, sys, time
out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
def on_term(signum, frame):
    time.sleep(0.2)  # a short drain
    (out / "worker.term").write_text(str(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore" else on_term)
if mode == "exit5":
    sys.exit(5)
# A flow-run process in a session of its own, as Prefect starts them: it must get SIGTERM too.
code = ("import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path(sys.argv[1]).write_text('x'), sys.exit(0)))\n"
        "pathlib.Path(sys.argv[2]).touch()\n"
        "time.sleep(60)\n")
subprocess.Popen([sys.executable, "-S", "-c", code, str(out / "flowrun.term"), str(out / "flowrun.ready")],
                 start_new_session=True)
while not (out / "flowrun.ready").exists():
    time.sleep(0.01)
(out / "worker.ready").touch()
while True:
    time.sleep(1)
"""


def worker_command(out: Path, mode: str = "drain") -> list[str]:
    return [sys.executable, "-S", "-c", WORKER, str(out), mode]


def in_thread(target) -> dict:
    """Run `target()` on a thread; the returned dict gets its `result`."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", target()), daemon=True)
    thread.start()
    box["thread"] = thread
    return box


@pytest.fixture
def gce_metadata():
    with serving(FakeGceMetadata()) as fake:
        yield fake


@pytest.fixture
def scheduled_events():
    with serving(FakeScheduledEvents()) as fake:
        yield fake


def test_gce_watcher_long_polls_until_preempted(gce_metadata):
    watcher = GcePreemptionWatcher(gce_metadata.url, wait_timeout_s=30)
    box = in_thread(lambda: watcher.wait_for_notice(threading.Event()))
    wait_for(lambda: any(r.query.get("wait_for_change") == "true" for r in gce_metadata.requests), "a long poll")
    assert "result" not in box
    gce_metadata.preempt()
    box["thread"].join(5)
    assert box["result"] == PreemptionNotice("gce-metadata")
    first, waiting = gce_metadata.requests[0], gce_metadata.requests[1]
    assert first.query == {} and first.headers["metadata-flavor"] == "Google"
    assert waiting.query == {"wait_for_change": "true", "last_etag": "0f9e8d7c6b5a", "timeout_sec": "30"}
    assert len(gce_metadata.requests) == 2  # the long poll answered at once: no busy polling


def test_gce_watcher_stops_when_asked(gce_metadata):
    gce_metadata.max_wait_s = 0.2
    stop = threading.Event()
    box = in_thread(lambda: GcePreemptionWatcher(gce_metadata.url, wait_timeout_s=1).wait_for_notice(stop))
    wait_for(lambda: len(gce_metadata.requests) >= 2, "polling")
    stop.set()
    box["thread"].join(5)
    assert box["result"] is None


def test_azure_watcher_takes_only_this_vms_preempt_event_and_acknowledges_it(scheduled_events):
    scheduled_events.schedule("Freeze", ["vm-a"])
    scheduled_events.schedule("Preempt", ["vm-b"])
    watcher = AzureScheduledEventsWatcher(scheduled_events.url, instance="vm-a", poll_s=0.05)
    box = in_thread(lambda: watcher.wait_for_notice(threading.Event()))
    wait_for(lambda: len(scheduled_events.requests) >= 3, "a few polls")
    assert "result" not in box
    event_id = scheduled_events.schedule("Preempt", ["vm-a"])
    box["thread"].join(5)
    notice = box["result"]
    assert (notice.source, notice.event_id) == ("azure-scheduled-events", event_id) and notice.not_before.endswith(
        "GMT"
    )
    request = scheduled_events.requests[0]
    assert request.query == {"api-version": "2020-07-01"} and request.headers["metadata"] == "true"
    watcher.acknowledge(notice)
    assert [approved for approved, _ in scheduled_events.approvals] == [event_id]
    assert all(e["EventId"] != event_id for e in scheduled_events.events)


def test_supervisor_drains_the_worker_and_its_flow_runs_on_the_gce_notice(gce_metadata, tmp_path):
    box = in_thread(lambda: supervise(worker_command(tmp_path), GcePreemptionWatcher(gce_metadata.url), grace_s=10))
    wait_for((tmp_path / "worker.ready").exists, "the worker")
    gce_metadata.preempt()
    box["thread"].join(10)
    assert box["result"] == 0
    assert (tmp_path / "worker.term").exists() and (tmp_path / "flowrun.term").exists()


def test_supervisor_acknowledges_the_azure_event_after_the_drain(scheduled_events, tmp_path):
    watcher = AzureScheduledEventsWatcher(scheduled_events.url, instance="vm-a", poll_s=0.05)
    box = in_thread(lambda: supervise(worker_command(tmp_path), watcher, grace_s=10))
    wait_for((tmp_path / "worker.ready").exists, "the worker")
    event_id = scheduled_events.schedule("Preempt", ["vm-a"])
    box["thread"].join(10)
    assert box["result"] == 0
    ((approved, approved_at),) = scheduled_events.approvals
    assert approved == event_id and approved_at >= float((tmp_path / "worker.term").read_text())


def test_supervisor_kills_a_worker_that_does_not_drain_in_time(gce_metadata, tmp_path):
    box = in_thread(
        lambda: supervise(worker_command(tmp_path, "ignore"), GcePreemptionWatcher(gce_metadata.url), grace_s=0.5)
    )
    wait_for((tmp_path / "worker.ready").exists, "the worker")
    gce_metadata.preempt()
    box["thread"].join(10)
    assert box["result"] == -9


def test_supervisor_returns_the_status_of_a_worker_that_exits_by_itself(gce_metadata, tmp_path):
    assert supervise(worker_command(tmp_path, "exit5"), GcePreemptionWatcher(gce_metadata.url), grace_s=1) == 5


def test_process_tree_lists_descendants():
    child = subprocess.Popen(
        [
            sys.executable,
            "-S",
            "-c",
            "import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-S', '-c', 'import time; time.sleep(30)']); "
            "print(p.pid, flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        grandchild = int(child.stdout.readline())
        assert process_tree(child.pid) == [child.pid, grandchild]
    finally:
        for pid in (grandchild, child.pid):
            os.kill(pid, 9)
        child.wait()


def test_cli_runs_the_command_under_the_gce_watcher(gce_metadata, tmp_path):
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infra.watchers",
            "gce",
            "--metadata-url",
            gce_metadata.url,
            "--grace-s",
            "10",
            "--",
            *worker_command(tmp_path),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for((tmp_path / "worker.ready").exists, "the worker", timeout_s=30)
    gce_metadata.preempt()
    output, _ = cli.communicate(timeout=30)
    assert cli.returncode == 0, output
    assert "preemption notice" in output and (tmp_path / "flowrun.term").exists()
