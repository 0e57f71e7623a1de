"""What a cloud VM's boot costs, with and without the run's wheelhouse (issue 26 item 5).

Ships the run's code as a training run does for a CPU `gcp` pool (the project's wheel, its lock,
the lock's wheelhouse: `infra.fleet.cloud_boot`) to a file:// store, then boots two "VMs" here
through the real boot script, each on an image with Python and a bare venv (created before the
clock starts), up to the start of its Prefect worker:
- `index`: no wheelhouse in the boot plan: pip installs the lock from this machine's configured
  index (a local disk here: no download, so a real index is slower);
- `wheelhouse`: the wheelhouse from the store, with the index unreachable (`--no-index`).
Prints one JSON line: both boots' seconds (and the load average when each started: other work on
the machine slows a boot), the wheelhouse's size and build time, the lock's size. `--torch V` pins
torch to V in the lock instead (e.g. a CUDA build on the index, for a GPU VM's dominant install).
    PYTHONPATH=$PWD python bench/boot.py [--torch 2.14.1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infra.fleet import code_bundle, wheelhouse
from infra.fleet.cloud_boot import pool_extras
from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.interface import BootPlan
from infra.providers.pool import PoolSpec
from infra.providers.startup import LOCK_ENV, WHEEL_ENV, WHEELHOUSE_ENV, render_startup_script
from rl.engine_spec import EngineSpec

UNREACHABLE_INDEX = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0"}
"""pip's environment on the wheelhouse VM: no configuration, an index that refuses connections."""

POOL = PoolSpec.model_validate(
    {
        "name": "cpu-spot",
        "provider": "gcp",
        "capacity_class": "spot",
        "size": 1,
        "machine_type": "n2-standard-8",
        "price_per_hour": 0.1,
        "gcp": {"project": "rollout-proj", "zones": ["us-central1-a"], "image": "img"},
    }
)


def boot_seconds(files: tuple, install_dir: Path, env: dict[str, str]) -> tuple[float, float]:
    """Seconds from the boot script's start to its worker's start, on a bare venv made beforehand,
    and the 1-minute load average when it started."""
    subprocess.run([sys._base_executable, "-m", "venv", str(install_dir / "venv")], check=True)
    script = render_startup_script(
        WorkerBootstrap(install_dir=str(install_dir)),
        pool=POOL,
        instance_id="bench-1",
        run_id="bench",
        watcher="gce",
        plan=BootPlan(files=files),
    )
    script = script.split("rlboost_log 'starting the Prefect worker")[0] + "exit 0\n"
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the boot failed:\n{done.stderr[-3000:]}")
    return seconds, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", help="pin torch to this version in the lock (default: the training run's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlboost-boot-") as scratch:
        root = Path(scratch)
        wheel = code_bundle.build_wheel()
        lock = root / "requirements.txt"
        pins = code_bundle.lock_requirements(wheel, pool_extras(POOL, EngineSpec(), "gs://b/s")).splitlines()
        if args.torch:
            pins = [f"torch=={args.torch}" if line.startswith("torch==") else line for line in pins]
        lock.write_text("\n".join(pins) + "\n")
        started = time.perf_counter()
        directory = wheelhouse.build(lock, root / "cache")
        archive = wheelhouse.pack(directory)
        build_s = time.perf_counter() - started
        store = (root / "store").as_uri()
        files = tuple(
            code_bundle.upload(path, store, None, env=env)
            for path, env in ((wheel, WHEEL_ENV), (lock, LOCK_ENV), (archive, WHEELHOUSE_ENV))
        )
        base = {"PATH": os.environ["PATH"], "HOME": scratch}
        index_s, index_load = boot_seconds(files[:2], root / "index", base)
        wheelhouse_s, wheelhouse_load = boot_seconds(files, root / "wheelhouse", {**base, **UNREACHABLE_INDEX})
        pins = [line for line in pins if line and not line.startswith("#")]
        print(
            json.dumps(
                {
                    "bench": "boot",
                    "boot_index_s": round(index_s, 1),
                    "boot_wheelhouse_s": round(wheelhouse_s, 1),
                    "load_avg_at_index_boot": round(index_load, 1),
                    "load_avg_at_wheelhouse_boot": round(wheelhouse_load, 1),
                    "torch": next(line for line in pins if line.startswith("torch==")),
                    "lock_requirements": len(pins),
                    "wheelhouse_wheels": len(list(directory.glob("*.whl"))),
                    "wheelhouse_mb": round(archive.stat().st_size / 1e6, 1),
                    "wheelhouse_build_s": round(build_s, 1),
                    "index": "local disk (this machine's pip configuration)",
                    "cpus": os.cpu_count(),
                }
            )
        )


if __name__ == "__main__":
    main()
