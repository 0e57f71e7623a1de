"""No process of a run outlives its driver: a real driver process starts a fabric (an embedded
redis-server and a local rollout worker process) from a short-lived thread, as a Prefect task
would, and is SIGKILLed once the worker registered; every process it started must be gone within
seconds. The same for a process holding a multiprocessing vLLM engine (its engine core) and for
`rlboost train` on Prefect's ephemeral server (the uvicorn process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import process_state, save_tiny_model, tiny_shape

pytestmark = pytest.mark.integration

DRIVER = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from infra.run.fabric_config import FabricConfig
    from tests.helpers import rollout_fabric

    config = FabricConfig.model_validate({
        "enabled": True,
        "pools": [{"name": "spot", "capacity_class": "spot", "size": 2, "machine_type": "cpu", "price_per_hour": 1.0}],
        "worker": {"heartbeat_s": 0.2, "ttl_s": 2.0},
    })
    fabrics = []
    starter = threading.Thread(
        target=lambda: fabrics.append(rollout_fabric(config, "orphans", Path(sys.argv[1]), Path(sys.argv[2])))
    )
    starter.start()
    starter.join()  # the thread that started Redis and the workers is gone
    while len(fabrics[0].registry.alive()) < 2:
        time.sleep(0.1)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    return process_state(pid) not in (None, "Z")


def _commands(pids: set[int]) -> dict[int, bytes]:
    """Each live process's command line."""
    commands = {}
    for pid in pids:
        try:
            commands[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            pass
    return commands


def _assert_all_gone(commands: dict[int, bytes], who: str, within_s: float = 20.0) -> None:
    """Every process in `commands` ends within `within_s` of `who`'s SIGKILL (those left are killed)."""
    killed = time.monotonic()
    while any(_alive(pid) for pid in commands) and time.monotonic() < killed + within_s:
        time.sleep(0.2)
    print(f"{who}'s {len(commands)} processes were gone {time.monotonic() - killed:.1f} s after its SIGKILL")
    left = {pid: command for pid, command in commands.items() if _alive(pid)}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"left running after {who} was killed: {left}"


def test_sigkilled_driver_leaves_no_worker_and_no_redis(tmp_path):
    save_tiny_model(tmp_path / "base", tiny_shape())
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path / "run"), str(tmp_path / "base")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[3],
    )
    try:
        assert driver.stdout.readline().strip() == "ready"
        commands = _commands(_descendants(driver.pid))
        assert sum(b"redis-server" in c for c in commands.values()) == 1, commands
        assert sum(b"infra.rollout.worker" in c for c in commands.values()) == 2, commands
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    _assert_all_gone(commands, "the driver", within_s=15)


VLLM_HOLDER = textwrap.dedent(
    """
    import sys, time
    from rl.config import VLLMOptions
    from rl.vllm_engine import VLLMEngine

    if __name__ == "__main__":
        VLLMEngine(
            sys.argv[1], 0, VLLMOptions(max_num_seqs=4, kv_cache_bytes=32 << 20, multiprocessing=True), dtype="fp32"
        )
        print("ready", flush=True)
        time.sleep(600)
    """
)


def test_sigkilled_rollout_process_leaves_no_vllm_engine_core(tmp_path):
    """vLLM's engine core (`vllm.multiprocessing: true`) is a child of the process that holds the
    engine, and vLLM gives it no way to notice that process's death: a silently preempted worker
    would leave it running. rlboost's vLLM plugin ends it (and its model worker) with its parent."""
    save_tiny_model(tmp_path / "base", tiny_shape())
    (tmp_path / "holder.py").write_text(VLLM_HOLDER)  # multiprocessing's spawn re-imports the main module
    holder = subprocess.Popen(
        [sys.executable, str(tmp_path / "holder.py"), str(tmp_path / "base")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[3],
    )
    try:
        lines = iter(holder.stdout.readline, "")  # vLLM logs on stdout too
        assert any(line.strip() == "ready" for line in lines), "the engine did not start"
        commands = _commands(_descendants(holder.pid))
        assert any(b"VLLM::EngineCore" in c for c in commands.values()), commands
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    _assert_all_gone(commands, "the engine's process", within_s=15)


def test_sigkilled_rlboost_train_leaves_no_ephemeral_prefect_server(tmp_path):
    """With no PREFECT_API_URL, `rlboost train` runs on Prefect's ephemeral API server, a uvicorn
    process that Prefect stops only at a normal exit; the guardian ends it after a SIGKILL."""
    save_tiny_model(tmp_path / "base", tiny_shape())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")
    sets = [f"model.path={tmp_path / 'base'}", f"run.output_dir={tmp_path / 'runs'}", "run.name=orphans"]
    driver = subprocess.Popen(
        [sys.executable, "-m", "infra.cli", "train", *(arg for s in sets for arg in ("--set", s))],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=Path(__file__).parents[3],
    )
    wanted = (b"uvicorn", b"infra.services.guardian", b"redis-server", b"infra.rollout.worker")
    commands: dict[int, bytes] = {}
    try:
        deadline = time.monotonic() + 180  # the ephemeral server migrates a fresh database first
        while time.monotonic() < deadline and driver.poll() is None:
            commands = _commands(_descendants(driver.pid))
            if all(any(w in c for c in commands.values()) for w in wanted):
                break
            time.sleep(0.5)
        assert all(any(w in c for c in commands.values()) for w in wanted), (driver.poll(), commands)
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    _assert_all_gone(commands, "the driver")
