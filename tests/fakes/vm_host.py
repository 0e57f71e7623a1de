"""The machines behind a `FakeGce`: every instance that reaches RUNNING boots, on this machine, as
a process group running the startup script the provider put in its metadata, with a GCE metadata
server of its own (`GCE_METADATA_HOST`).

- `preempt(name)`: the cloud preempts the VM: the instance goes STOPPING with a preempted operation
  and its metadata server answers `instance/preempted` = TRUE, which the VM's watcher turns into
  SIGTERM for its worker;
- a VM deleted through the API (STOPPING without a preemption) gets SIGTERM, as a guest shutdown
  does;
- either way the process group gets SIGKILL after `grace_s`, and once it is gone the instance
  disappears from the fake cloud (termination action DELETE); `reclaim_together(names)` powers
  none of several preempted VMs off before all are ready to be.

Each VM's output goes to `<workdir>/<name>.log`; `booted` lists every VM that ever booted.

`bake_image_venv(install_dir)` makes the VMs' image: `<install_dir>/venv`, a real virtual
environment whose preinstalled dependencies are this test environment's (a `.pth` line, as an
image with torch baked in would have them), without the project itself: the boot script installs
the run's wheel into it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.fakes.gce import FakeGce
from tests.fakes.metadata import FakeGceMetadata


def bake_image_venv(install_dir: Path) -> Path:
    """`<install_dir>/venv` with this environment's packages visible but not the project (see above)."""
    venv = install_dir / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # A plain path line: the directory joins sys.path, its own .pth files (the editable install) do not run.
    (Path(site) / "image-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def run_boot_script(script: str, workdir: Path, name: str, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    """Start a VM's boot script in bash, in a process group of its own, with `<workdir>/<name>` as
    its home and working directory and its output in `<workdir>/<name>.log`."""
    log = workdir / f"{name}.log"
    home = workdir / name
    home.mkdir(exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", script],
            cwd=home,
            env={**env, "HOME": str(home)},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, log


@dataclass
class BootedVm:
    name: str
    zone: str
    process: subprocess.Popen
    metadata: FakeGceMetadata
    log: Path
    kill_at: float | None = None
    """When the VM is powered off (set once it is told to stop)."""


class VmHostThread:
    """The lifecycle both fake clouds' VM hosts share: a thread runs `_loop` (boot what the cloud
    started, power off what it stopped) from `__enter__` on; `__exit__` stops it and powers off
    every VM still up. Subclasses are dataclasses with `workdir`, `booted` and `gone`, and define
    `_loop()` and `_power_off(vm)`."""

    workdir: Path
    booted: dict
    gone: set[str]

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._together: list[set[str]] = []

    def __enter__(self):
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for vm in list(self.booted.values()):
            if vm.name not in self.gone:
                self._power_off(vm)

    def running(self) -> list[str]:
        """VMs booted and not told to stop."""
        with self._lock:
            return [n for n, vm in self.booted.items() if vm.kill_at is None and n not in self.gone]

    def reclaim_together(self, names: list[str]) -> None:
        """The zone takes these VMs back at once: each gets its own notice (a subclass's `reclaim`),
        and none is powered off before all of them are ready to be (drained, or out of time)."""
        with self._lock:
            self._together.append(set(names))
        for name in names:
            self.reclaim(name)

    def reclaim(self, name: str) -> None:
        raise NotImplementedError

    def _power_off_ready(self, ready: set[str]) -> None:
        """Power off each VM of `ready` whose reclaim group (if any) is ready as a whole."""
        for name in sorted(ready):
            group = next((g for g in self._together if name in g), {name})
            if group <= ready | self.gone:
                self._power_off(self.booted[name])


@dataclass
class FakeVmHost(VmHostThread):
    gce: FakeGce
    workdir: Path
    env: dict[str, str]
    """The VMs' base environment (each also gets `GCE_METADATA_HOST`)."""
    grace_s: float = 30.0
    poll_s: float = 0.2
    booted: dict[str, BootedVm] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)

    def reclaim(self, name: str) -> None:
        self.preempt(name)

    def preempt(self, name: str) -> None:
        with self._lock:
            self.preempted.add(name)
        self.gce.preempt(name)

    # -- the machines ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self.gce.lock:
                instances = {name: (zone, dict(body)) for (zone, name), body in self.gce.instances.items()}
            for name, (zone, body) in instances.items():
                if body["status"] == "RUNNING" and name not in self.booted:
                    self._boot(name, zone, body)
            ready: set[str] = set()
            for vm in list(self.booted.values()):
                if vm.name in self.gone:
                    continue
                status = instances.get(vm.name, (None, {"status": "GONE"}))[1]["status"]
                if status != "RUNNING" and vm.kill_at is None:
                    self._stopping(vm)
                if vm.kill_at is not None and (vm.process.poll() is not None or time.time() >= vm.kill_at):
                    ready.add(vm.name)
            self._power_off_ready(ready)

    def _boot(self, name: str, zone: str, body: dict) -> None:
        script = next(item["value"] for item in body["metadata"]["items"] if item["key"] == "startup-script")
        metadata = FakeGceMetadata(max_wait_s=2.0)
        metadata.start()
        env = {**self.env, "GCE_METADATA_HOST": metadata.url.removeprefix("http://")}
        process, log = run_boot_script(script, self.workdir, name, env)
        with self._lock:
            self.booted[name] = BootedVm(name, zone, process, metadata, log)

    def _stopping(self, vm: BootedVm) -> None:
        if vm.name in self.preempted:
            vm.metadata.preempt()  # the watcher sends the notice
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(vm.process.pid, signal.SIGTERM)  # guest shutdown on delete
        vm.kill_at = time.time() + self.grace_s

    def _power_off(self, vm: BootedVm) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(vm.process.pid, signal.SIGKILL)
        vm.process.wait()
        vm.metadata.stop()
        with self.gce.lock:
            self.gce.instances.pop((vm.zone, vm.name), None)
        with self._lock:
            self.gone.add(vm.name)
