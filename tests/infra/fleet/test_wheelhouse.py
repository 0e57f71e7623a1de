"""The run's wheelhouse: built with pip from a lock (a two-package subset here, not torch), cached
by the lock's content, its manifest checked on reuse (a corrupt wheel is one clear line), packed
byte-identically and uploaded content-addressed, and shipped in each pool's boot plan."""

from __future__ import annotations

import hashlib
import tarfile

import pytest

from infra.fleet import code_bundle, wheelhouse
from infra.fleet.cloud_boot import CloudBoot
from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.startup import LOCK_ENV, WHEEL_ENV, WHEELHOUSE_ENV
from rl.engine_spec import EngineSpec
from tests.infra.fleet.test_code_bundle import gcp_pool

SMALL_LOCK = "# two pure-Python wheels of constraints.txt\ncachetools==7.3.3\nmdurl==0.1.2\n"
"""A lock subset: what `code_bundle.lock_requirements` writes, small enough for a test."""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The small lock's wheelhouse, built once for the module (pip from the configured index)."""
    root = tmp_path_factory.mktemp("wheelhouse")
    lock = root / "requirements.txt"
    lock.write_text(SMALL_LOCK)
    return lock, root / "cache", wheelhouse.build(lock, root / "cache")


def test_the_wheelhouse_holds_every_locked_wheel_with_its_sha256_and_is_reused(built):
    lock, cache, directory = built
    wheels = sorted(p.name for p in directory.glob("*.whl"))
    assert [w.split("-")[:2] for w in wheels] == [["cachetools", "7.3.3"], ["mdurl", "0.1.2"]]
    manifest = (directory / wheelhouse.MANIFEST).read_text().splitlines()
    assert manifest == [f"{hashlib.sha256((directory / w).read_bytes()).hexdigest()}  {w}" for w in wheels]
    built_at = (directory / wheels[0]).stat().st_mtime_ns
    assert wheelhouse.build(lock, cache) == directory and (directory / wheels[0]).stat().st_mtime_ns == built_at
    other = lock.with_name("other.txt")
    other.write_text("cachetools==7.3.3\n")
    assert wheelhouse.build(other, cache) != directory, "another lock, another wheelhouse"


def test_a_corrupt_cached_wheel_is_one_line_naming_it_and_the_fix(built, tmp_path):
    lock, cache, directory = built
    copy = tmp_path / "cache" / "wheelhouse" / directory.name
    copy.parent.mkdir(parents=True)
    copy.mkdir()
    for path in directory.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    [victim] = copy.glob("mdurl-*.whl")
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(wheelhouse.WheelhouseError) as error:
        wheelhouse.build(lock, tmp_path / "cache")
    message = str(error.value)
    assert "\n" not in message and victim.name in message and "not the" in message
    assert message.endswith(f"delete {copy} to build it again")
    victim.unlink()
    with pytest.raises(wheelhouse.WheelhouseError, match=f"{victim.name} has sha256 missing"):
        wheelhouse.verify(copy)


def test_the_archive_is_byte_identical_for_the_same_wheels_and_uploaded_once(built, tmp_path):
    _, _, directory = built
    archive = wheelhouse.pack(directory)
    with tarfile.open(archive) as tar:
        assert tar.getnames() == [wheelhouse.MANIFEST, *sorted(p.name for p in directory.glob("*.whl"))]
        assert {m.mtime for m in tar.getmembers()} == {0} and {m.uid for m in tar.getmembers()} == {0}
    first = archive.read_bytes()
    archive.unlink()
    assert wheelhouse.pack(directory).read_bytes() == first, "deterministic: a rebuilt wheelhouse keeps its sha256"
    store = (tmp_path / "store").as_uri()
    shipped = code_bundle.upload(archive, store, None, env=WHEELHOUSE_ENV)
    assert shipped.url == f"{store}/code/{hashlib.sha256(first).hexdigest()}/{archive.name}"
    copy = tmp_path / "store" / "code" / shipped.sha256 / archive.name
    written_at = copy.stat().st_mtime_ns
    assert code_bundle.upload(archive, store, None, env=WHEELHOUSE_ENV) == shipped
    assert copy.stat().st_mtime_ns == written_at, "a second run of the same lock uploads nothing"


def test_each_pool_ships_its_locks_wheelhouse_unless_turned_off(built, tmp_path, monkeypatch):
    _, cache, directory = built
    monkeypatch.setenv(code_bundle.CACHE_ENV, str(cache))
    monkeypatch.setattr(code_bundle, "lock_requirements", lambda wheel, extras: SMALL_LOCK)
    wheel = tmp_path / "rlboost-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"the run's wheel")
    store = (tmp_path / "store").as_uri()
    boot = CloudBoot(runs=None, engine=EngineSpec())  # type: ignore[arg-type]  # `plan` never asks Prefect
    boot.ship([gcp_pool()], WorkerBootstrap(wheel=str(wheel)), store, None, tmp_path / "code")
    files = boot.plan(gcp_pool(), "flow-run-1").files
    assert [f.env for f in files] == [WHEEL_ENV, LOCK_ENV, WHEELHOUSE_ENV]
    archive = wheelhouse.pack(directory)
    assert files[2].sha256 == code_bundle.sha256_of(archive), "the cached wheelhouse, not a new build"
    assert files[2].url == f"{store}/code/{files[2].sha256}/{archive.name}"

    off = CloudBoot(runs=None, engine=EngineSpec())  # type: ignore[arg-type]
    off.ship([gcp_pool()], WorkerBootstrap(wheel=str(wheel), wheelhouse=False), store, None, tmp_path / "code")
    assert [f.env for f in off.plan(gcp_pool(), "flow-run-2").files] == [WHEEL_ENV, LOCK_ENV]
