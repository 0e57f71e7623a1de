"""Shared pytest setup."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
import torch

PRETRAINED_TIMEOUT_S = 1200
"""The timeout of a test that uses `pretrained_tiny_model`: such a test may wait for the pretraining
within its own (25-130 s of pretraining on a 2-core host; past the default 600 s once on a loaded CI
host)."""


INTEGRATION_MODULE = re.compile(r"^pytestmark = \[?\s*pytest\.mark\.integration\b", re.MULTILINE)
"""A test module whose every test is an integration test (its module-level mark)."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m "not integration"`` (`make test-unit`) a module marked integration as a whole is
    not imported: none of its tests would run, and importing them (the flows, Prefect, the cloud
    SDKs) took most of the unit run's collection."""
    if config.getoption("markexpr") != "not integration" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py" or not INTEGRATION_MODULE.search(collection_path.read_text()):
        return None
    return True


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` (`make test`) spreads the files that train for minutes over the workers
    (`tests.xdist_schedule`)."""
    if config.getoption("dist") != "loadfile":
        return None
    from tests.xdist_schedule import SpreadLongTraining

    return SpreadLongTraining(config, log)


def _trains_from_the_pretrained_model(item: pytest.Item) -> bool:
    return "pretrained_tiny_model" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _trains_from_the_pretrained_model(item):
            item.add_marker(pytest.mark.timeout(PRETRAINED_TIMEOUT_S))


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models run faster on one intra-op thread than on contended shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _ledger_in_a_temporary_database(tmp_path_factory):
    """Training runs in tests record their costs in a throwaway SQLite ledger, not .rlboost/."""
    url = f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.sqlite'}"
    previous = os.environ.get("RLBOOST_LEDGER_URL")
    os.environ["RLBOOST_LEDGER_URL"] = url
    yield url
    if previous is None:
        os.environ.pop("RLBOOST_LEDGER_URL", None)
    else:
        os.environ["RLBOOST_LEDGER_URL"] = previous


@pytest.fixture(scope="session", autouse=True)
def _prefect_seeds_shared_by_the_run(tmp_path_factory):
    """The migrated Prefect database that new Prefect homes start from (`infra.services.prefect_seed`)
    is made once per test run, in the run's temporary directory that every xdist worker shares (not
    in ~/.cache), and reaches the subprocesses through the environment."""
    from rl.env_vars import PREFECT_SEED_CACHE

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    previous = os.environ.get(PREFECT_SEED_CACHE)
    os.environ[PREFECT_SEED_CACHE] = str(shared / "prefect-seeds")
    yield shared / "prefect-seeds"
    if previous is None:
        os.environ.pop(PREFECT_SEED_CACHE, None)
    else:
        os.environ[PREFECT_SEED_CACHE] = previous


@pytest.fixture(scope="session")
def prefect_harness():
    """One ephemeral Prefect server (SQLite) for the whole session."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def redis_url():
    """One embedded redis-server (free loopback port, random password, no persistence)."""
    from infra.services.redis_embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def redis_cluster_url():
    """One local 3-master Redis Cluster (free loopback ports, random password, no persistence),
    stopped with its processes at the session's end."""
    from infra.services.redis_cluster import LocalRedisCluster

    with LocalRedisCluster(masters=3) as cluster:
        yield cluster.url


@pytest.fixture
def redis_client(redis_url):
    """A binary (decode_responses=False) client of the session's embedded Redis."""
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def clock():
    """A manual clock for the cloud fakes and providers (`tests.helpers.Clock`)."""
    from tests.helpers import Clock

    return Clock()


@pytest.fixture
def gce(clock):
    """A fake Compute Engine on loopback; the test fails if the SDK sent anything malformed."""
    from tests.fakes.gce import FakeGce
    from tests.fakes.support import serving

    with serving(FakeGce(clock=clock)) as fake:
        yield fake


def _shared_directory(config: pytest.Config) -> Path:
    """The run's temporary directory that every pytest-xdist worker shares (each worker's own
    base temporary directory is below it)."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]  # pytest's tmp_path plugin
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the run holds a test that trains from `pretrained_tiny_model`, its pretraining starts at
    once in a process of its own (`tests.pretrained`), beside the first tests: the first xdist
    worker starts it, tied to xdist's controller (its parent), or pytest itself without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker not in (None, "gw0") or session.config.option.collectonly:
        return
    if any(_trains_from_the_pretrained_model(item) for item in session.items):
        from tests.pretrained import start_in_background

        run_pid = os.getppid() if worker else os.getpid()
        process = start_in_background(_shared_directory(session.config), run_pid)
        threading.Thread(target=process.wait, name="pretraining-reaper", daemon=True).start()  # no zombie


@pytest.fixture(scope="session")
def pretrained_tiny_model(request):
    """The demo's base model, pretrained once per run by the demo's recipe
    (deployments/configs/demo.yaml `pretrain`: to 50% held-out greedy accuracy, 300 steps for its
    seed; 40-130 s on 2 cores), in the background from the run's start (`tests.pretrained`). Its
    directory: read it, don't write to it."""
    from tests.pretrained import PretrainingFailed, pretrained_model

    try:
        return pretrained_model(_shared_directory(request.config))
    except PretrainingFailed as failure:
        pytest.fail(str(failure))
