"""The machines behind a `FakeArm`: every VM that reaches `Succeeded` boots, on this machine, as a
process group running its custom data (the boot script the provider sent), with an Instance
Metadata Service of its own (`FakeScheduledEvents`, reached through `RLBOOST_AZURE_IMDS_URL`).

- `evict(name)`: Azure evicts the Spot VM: its Scheduled Events document gets a `Preempt` event
  for it (`NotBefore` 30 s on), which the VM's watcher turns into SIGTERM for its worker; once
  the VM approves the event (`StartRequests`) or the notice runs out, it is powered off and,
  eviction policy Delete, goes `Deleting` and then disappears from the fake cloud;
- a VM deleted through the API (`Deleting` without an eviction) gets SIGTERM, as a guest shutdown
  does, and SIGKILL after `grace_s`; then it disappears.

`reclaim_together(names)` evicts several VMs and powers none off before all are ready to be.
Each VM's output goes to `<workdir>/<name>.log`; `booted` lists every VM that ever booted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra.watchers.azure_events import IMDS_URL_ENV
from tests.fakes.arm import FakeArm
from tests.fakes.metadata import FakeScheduledEvents
from tests.fakes.vm_host import VmHostThread, run_boot_script


@dataclass
class BootedAzureVm:
    name: str
    process: subprocess.Popen
    imds: FakeScheduledEvents
    log: Path
    event_id: str | None = None
    """The eviction's Scheduled Events id, once evicted."""
    kill_at: float | None = None


@dataclass
class FakeAzureVmHost(VmHostThread):
    arm: FakeArm
    workdir: Path
    env: dict[str, str]
    """The VMs' base environment (each also gets `RLBOOST_AZURE_IMDS_URL`)."""
    grace_s: float = 30.0
    notice_s: float = 30.0
    poll_s: float = 0.2
    booted: dict[str, BootedAzureVm] = field(default_factory=dict)
    evicted: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)

    def reclaim(self, name: str) -> None:
        self.evict(name)

    def evict(self, name: str) -> None:
        with self._lock:
            vm = self.booted[name]
            self.evicted.add(name)
            vm.event_id = vm.imds.schedule("Preempt", [name], notice_s=self.notice_s)
            vm.kill_at = time.time() + self.notice_s

    # -- the machines ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self.arm.lock:
                states = {name: vm["properties"]["provisioningState"] for name, vm in self.arm.vms.items()}
            for name, state in states.items():
                if state == "Succeeded" and name not in self.booted:
                    self._boot(name)
            ready: set[str] = set()
            for vm in list(self.booted.values()):
                if vm.name in self.gone:
                    continue
                if vm.name in self.evicted:
                    approved = any(event == vm.event_id for event, _ in vm.imds.approvals)
                    if approved or time.time() >= (vm.kill_at or 0):
                        ready.add(vm.name)
                    continue
                if states.get(vm.name, "Gone") != "Succeeded" and vm.kill_at is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(vm.process.pid, signal.SIGTERM)  # guest shutdown on delete
                    vm.kill_at = time.time() + self.grace_s
                if vm.kill_at is not None and (vm.process.poll() is not None or time.time() >= vm.kill_at):
                    ready.add(vm.name)
            self._power_off_ready(ready)

    def _boot(self, name: str) -> None:
        with self.arm.lock:
            script = self.arm.custom_data[name]
        imds = FakeScheduledEvents()
        imds.start()
        process, log = run_boot_script(script, self.workdir, name, {**self.env, IMDS_URL_ENV: imds.url})
        with self._lock:
            self.booted[name] = BootedAzureVm(name, process, imds, log)

    def _power_off(self, vm: BootedAzureVm) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(vm.process.pid, signal.SIGKILL)
        vm.process.wait()
        vm.imds.stop()
        if vm.name in self.evicted:
            self.arm.evict(vm.name)  # eviction policy Delete: the VM goes Deleting, then away
            time.sleep(self.poll_s)
        with self.arm.lock:
            self.arm.vms.pop(vm.name, None)
        with self._lock:
            self.gone.add(vm.name)
