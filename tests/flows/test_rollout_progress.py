"""The `rollout` task's progress artifact belongs to its task run, although the progress comes on
the fabric's delivery thread (which has no Prefect run context), and is made without Prefect's
"artifact outside a flow or task run" warning. The session here stands in for a rollout that
reports from another thread, as `TrainingSession.rollout` does over `GroupProgress`."""

from __future__ import annotations

import asyncio
import threading
import warnings
from types import SimpleNamespace

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from infra.run import session as sessions
from tasks.training import rollout_task

pytestmark = pytest.mark.integration


class ThreadedRollout:
    config = SimpleNamespace(run=SimpleNamespace(name="progress-test"))

    def rollout(self, step, on_progress, last_step):
        def deliver():  # the fabric's delivery thread: groups 3 and 4 of 4 complete
            on_progress(3, 4)
            on_progress(4, 4)

        thread = threading.Thread(target=deliver)
        thread.start()
        thread.join()
        return {"step": step}


@flow(persist_result=False)
def one_rollout() -> str:
    future = rollout_task.submit("progress-test-session", 1)
    future.result()
    return str(future.task_run_id)


def test_the_progress_artifact_of_a_rollout_belongs_to_its_task_run(prefect_harness, monkeypatch):
    monkeypatch.setitem(sessions._SESSIONS, "progress-test-session", ThreadedRollout())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task_run_id = one_rollout()

    async def artifacts():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["progress-test-rollout"]))
            )

    (artifact,) = asyncio.run(artifacts())
    assert str(artifact.task_run_id) == task_run_id
    assert artifact.data == 100.0
    assert not [w for w in caught if "Artifact creation outside" in str(w.message)]
