"""Chaos: a multi-step `rlboost train` on the fabric under random faults of every kind, and what it
kept.

    .venv/bin/python bench/chaos.py [--steps 20 --mean-gap-s 4 --seed 0 --staleness K --faults KINDS]

Faults at random gaps, each kind (of `--faults`) at least once: a rollout worker SIGTERMed,
SIGKILLed or SIGSTOPped (a zombie); the driver SIGKILLed mid-step and run again at once; the token
log's redis-server SIGKILLed and restarted on its append-only file; a peer weight server SIGKILLed
while an instance pulls from it; `instance_start`: a worker SIGTERMed whose replacement fails at
start (`tests/fakes/start_fault`), replaced in turn; `node` (if named: DeepSpeed over 2 loopback
"nodes", the second an `rlboost trainer-node`): its agent SIGKILLed. Every step's samples are then
generated again from the checkpoints of their versions and compared token by token (~4 minutes on
2 cores). Ends with ONE JSON line: {"steps", "faults": {kind: count}, "samples_lost",
"samples_duplicated", "responses_identical_fraction", "orphans_left", "open_ledger_instances",
"instances_replaced", "minutes", ...}. Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "ERROR")
os.environ.setdefault("DO_NOT_TRACK", "1")  # no telemetry writes racing the harness's SQLite
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import redis  # noqa: E402
import yaml  # noqa: E402

from infra.keyspace import controller_prefix, current_step_key, weights_prefix  # noqa: E402
from infra.rollout.registry import InstanceRegistry  # noqa: E402
from infra.services.ports import free_port  # noqa: E402
from infra.services.redis_embedded import EmbeddedRedis  # noqa: E402
from rl import env_vars

KINDS = ("worker", "driver", "redis", "peer", "instance_start", "node")
DEFAULT_KINDS = KINDS[:-1]
"""`node` changes the run's trainer (DeepSpeed over two nodes): only when `--faults` names it."""
FAULT = ROOT / "tests" / "fakes" / "start_fault"
"""On the driver's PYTHONPATH: a rollout worker that finds a file in `START_FAULT_DIR` fails at start."""
WORKER_SIGNALS = (signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP)
REAP_TIMEOUT_S = 2.0
PROMPTS, GROUP = 4, 4


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, start time, command line) of every process (from /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z":
            found[int(stat.parent.name)] = (int(fields[1]), fields[19], cmdline)
    return found


def _descendants(pid: int, table: dict[int, tuple[int, str, str]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for child, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


class Chaos:
    """The run, its drivers, and the faults injected into it."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.redis = EmbeddedRedis(appendfsync="everysec", directory=work / "redis", port=free_port())
        self.redis.start()
        self.client = redis.Redis.from_url(self.redis.url, socket_timeout=2.0)
        self.run_dir = work / "runs" / "chaos"
        self.armed = work / "fail-starts"
        """One file here fails the next rollout worker's start (`instance_start`)."""
        self.armed.mkdir(parents=True, exist_ok=True)
        self.driver: subprocess.Popen | None = None
        self.done = threading.Event()
        self.faults: Counter[str] = Counter()
        self.signals: Counter[str] = Counter()
        self.attempts = 0
        self.exit_codes: list[int] = []
        self.started: dict[tuple[int, str], str] = {}
        """(pid, start time) -> command line of every process a driver (or the trainer node) started."""
        self.rendezvous = f"127.0.0.1:{free_port()}" if "node" in args.faults else None
        """With the `node` fault: the trainer's rendezvous (the driver's node hosts it)."""
        self.node: subprocess.Popen | None = None
        """The second trainer node's `rlboost trainer-node`."""
        self.node_exit_codes: list[int] = []
        self._lock = threading.Lock()

    # -- the run --------------------------------------------------------------------------------

    def config(self, model: Path) -> Path:
        settings = {
            "run": {
                "name": "chaos",
                "output_dir": str(self.work / "runs"),
                "steps": self.args.steps,
                "checkpoint_every": 1,
                "keep_checkpoints": self.args.steps + 1,
            },
            "model": {"path": str(model)},
            "data": {"family": "chain"},
            "rollout": {"prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": self.args.max_new_tokens},
            "eval": {"size": 4, "every": 10_000},
            "training": {"max_staleness": self.args.staleness},
            "ledger": {"trainer": {"machine_type": "n2-standard-8", "price_per_hour": 0.4}},
            "fabric": {
                "enabled": True,
                "redis_url": self.redis.url,
                "pools": [
                    {
                        "name": "reserved",
                        "capacity_class": "reserved",
                        "size": 1,
                        "machine_type": "cpu",
                        "price_per_hour": 3.0,
                    },
                    {"name": "spot", "capacity_class": "spot", "size": 2, "machine_type": "cpu", "price_per_hour": 1.0},
                ],
                "worker": {"slots": 2, "flush_tokens": 2, "flush_ms": 20, "heartbeat_s": 0.2, "ttl_s": REAP_TIMEOUT_S},
                "controller": {"reap_timeout_s": REAP_TIMEOUT_S, "max_reaps": 100},
                # faults a few seconds apart fail several instances of a pool before one registers
                "max_instance_failures": 20,
                "weights": {"chunk_mb": 0.05, "upload_cap_mb_s": self.args.upload_cap_mb_s},
            },
        }
        if self.rendezvous is not None:
            settings["trainer"] = {
                "backend": "deepspeed",
                "world_size": 2,
                "nodes": 2,
                "rendezvous": self.rendezvous,
                "threads_per_rank": 1,
                "start_timeout_s": 300,
            }
        path = self.work / "run.yaml"
        path.write_text(yaml.safe_dump(settings))
        return path

    def supervise(self, config: Path, env: dict[str, str]) -> None:
        """Run the driver until an attempt ends with status 0; a killed or failed one is run again."""
        command = [sys.executable, "-m", "infra.cli", "train", "--config", str(config)]
        try:
            while self.attempts < self.args.max_attempts:
                self.attempts += 1
                with (self.work / f"driver-{self.attempts}.log").open("w") as out:
                    driver = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
                with self._lock:
                    self.driver = driver
                code = driver.wait()
                self.exit_codes.append(code)
                if code == 0:
                    return
        finally:
            self.done.set()

    def operate_node(self, env: dict[str, str]) -> None:
        """The second trainer node: `rlboost trainer-node`, started again whenever it exits while the
        run goes on (as an operator would); it exits by itself once a driver closes the trainer."""
        command = [
            sys.executable, "-m", "infra.cli", "trainer-node", "--rendezvous", str(self.rendezvous),
            "--run-id", "chaos", "--nproc-per-node", "1", "--join-timeout", "300",
            "--log-file", str(self.work / "trainer-node-agents.log"),
        ]  # fmt: skip
        while not self.done.is_set():
            with (self.work / f"trainer-node-{len(self.node_exit_codes) + 1}.log").open("w") as out:
                node = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            self.node = node
            while node.poll() is None and not self.done.is_set():
                time.sleep(0.3)
            try:
                self.node_exit_codes.append(node.wait(60))  # the last driver closed the trainer: it ends
            except subprocess.TimeoutExpired:
                node.terminate()
                self.node_exit_codes.append(node.wait())
            if self.node_exit_codes[-1] == 0:  # a driver closed the trainer: the run is over
                return

    def track(self) -> None:
        """Remember every process below the current driver and the trainer node (to find orphans at the end)."""
        while not self.done.is_set():
            table = _processes()
            for parent in (self.driver, self.node):
                if parent is not None and parent.poll() is None:
                    for pid in _descendants(parent.pid, table):
                        self.started.setdefault((pid, table[pid][1]), table[pid][2])
            time.sleep(0.3)

    # -- faults ---------------------------------------------------------------------------------

    def run_id(self) -> str | None:
        try:
            return json.loads((self.run_dir / "identity.json").read_text())["run_id"]
        except (OSError, ValueError, KeyError):
            return None

    def in_a_step(self) -> int | None:
        """The step under way, once a checkpoint exists and every instance is registered."""
        run_id = self.run_id()
        driver = self.driver
        if run_id is None or driver is None or driver.poll() is not None:
            return None
        try:
            newest, first = self.client.hmget(current_step_key(run_id), "step", "first")
            current = first or newest  # the step rolling out (later ones may be admitted ahead)
            alive = InstanceRegistry(self.client, run_id).alive()
        except redis.RedisError:
            return None
        if current is None or len(alive) < 2 or not (self.run_dir / "checkpoints" / "latest").exists():
            return None
        step = int(current)
        finished = self.client.hexists(controller_prefix(run_id) + f"step:{step}", "report")
        return None if finished else step

    def workers(self) -> dict[str, int]:
        """instance id -> pid of the current driver's live rollout workers."""
        driver = self.driver
        if driver is None:
            return {}
        table = _processes()
        found = {}
        for pid in _descendants(driver.pid, table):
            words = table[pid][2].split()
            if "infra.rollout.worker" in words and "--instance-id" in words:
                found[words[words.index("--instance-id") + 1]] = pid
        return found

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """`env`, with the `instance_start` fault armable in the drivers' rollout workers."""
        path = os.pathsep.join(p for p in (str(FAULT), str(ROOT), env.get("PYTHONPATH", "")) if p)
        return {**env, "PYTHONPATH": path, "START_FAULT_DIR": str(self.armed)}

    def inject(self) -> None:
        kinds = self.args.faults
        first = (*kinds, *(["worker", "worker"] if "worker" in kinds else []))  # every worker signal once
        order = itertools.chain(first, iter(lambda: self.rng.choice(kinds), None))
        kind = next(order)
        while not self.done.wait(self.rng.expovariate(1 / self.args.mean_gap_s)):
            if self.in_a_step() is None:
                continue
            if getattr(self, f"_{kind}")():
                self.faults[kind] += 1
                print(f"fault {kind} ({sum(self.faults.values())} so far)", flush=True)
                kind = next(order)

    def _worker(self) -> bool:
        workers = self.workers()
        if not workers:
            return False
        pid = workers[self.rng.choice(sorted(workers))]
        sent = WORKER_SIGNALS[self.faults["worker"] % len(WORKER_SIGNALS)]
        os.kill(pid, sent)
        self.signals[sent.name] += 1
        if sent == signal.SIGSTOP:
            threading.Timer(2 * REAP_TIMEOUT_S, lambda: _signal(pid, signal.SIGCONT)).start()
        return True

    def _instance_start(self) -> bool:
        """Arm one failed start, SIGTERM a worker (it hands its samples back and exits), and wait
        until its replacement has failed at start (the fault's file taken)."""
        workers = self.workers()
        if not workers:
            return False
        token = self.armed / f"fault-{sum(self.faults.values())}"
        token.touch()
        _signal(workers[self.rng.choice(sorted(workers))], signal.SIGTERM)
        deadline = time.monotonic() + 60
        while token.exists() and time.monotonic() < deadline and not self.done.is_set():
            time.sleep(0.05)
        if token.exists():  # no worker started (the driver died meanwhile): disarm
            token.unlink(missing_ok=True)
            return False
        return True

    def _driver(self) -> bool:
        driver = self.driver
        if driver is None or driver.poll() is not None:
            return False
        driver.kill()
        return True

    def _node(self) -> bool:
        """SIGKILL the second node's torchrun agent (its rank dies with it): the step fails naming the
        node, the driver exits and is run again, the node's command joins the re-run."""
        node = self.node
        if node is None or node.poll() is not None:
            return False
        table = _processes()
        agents = [pid for pid in _descendants(node.pid, table) if _is_agent(table[pid][2])]
        driver = self.driver
        if not agents or driver is None or not self.workers():
            return False
        # Both nodes' ranks are up and this driver's fabric too: the node is in this driver's group
        # (a failed driver's ranks are gone before it exits).
        for parent in (node.pid, driver.pid):
            if not any(_is_rank(table[pid][2]) for pid in _descendants(parent, table)):
                return False
        _signal(agents[0], signal.SIGKILL)
        return True

    def _redis(self) -> bool:
        os.kill(self.redis.pid, signal.SIGKILL)
        time.sleep(1.0)
        self.redis.stop()
        self.redis.start()  # same port, password and append-only file
        return True

    def _peer(self) -> bool:
        """SIGKILL a holder of the version an instance is pulling, while it pulls."""
        run_id = self.run_id()
        deadline = time.monotonic() + 3 * self.args.mean_gap_s
        while run_id is not None and time.monotonic() < deadline and not self.done.is_set():
            try:
                leases = [
                    m.decode().split(":", 1) for m in self.client.zrange(weights_prefix(run_id) + "leases", 0, -1)
                ]
                alive = InstanceRegistry(self.client, run_id).alive()
            except redis.RedisError:
                return False
            workers = self.workers()
            for version, puller in leases:
                holders = [
                    i.spec.instance_id
                    for i in alive
                    if i.policy_version == int(version) and i.spec.instance_id not in (puller,)
                ]
                holders = [h for h in holders if h in workers]
                if holders:
                    _signal(workers[self.rng.choice(holders)], signal.SIGKILL)
                    return True
            time.sleep(0.02)
        return False


def _is_agent(command: str) -> bool:
    return "-m rl.distributed.agent" in command


def _is_rank(command: str) -> bool:
    """A trainer rank (its agent's command line names the rank's module too)."""
    return "-m rl.distributed.rank" in command and not _is_agent(command)


def _signal(pid: int, sent: signal.Signals) -> None:
    try:
        os.kill(pid, sent)
    except ProcessLookupError:
        pass


def _alive(pid: int, started: str) -> bool:
    table = _processes()
    return pid in table and table[pid][1] == started


def regenerate(engine, load_version, requests: list, schedules: dict[str, list[tuple[int, int]]]) -> dict[str, list]:
    """Each request's response generated in process as the run generated it: span by span, each
    span's tokens from the policy version that generated them (`schedules`: sample id -> (first
    token, version) spans; one span from token 0 when strictly on-policy)."""
    from dataclasses import replace

    done: dict[str, list[int]] = {r.sample_id: [] for r in requests}
    live = {r.sample_id for r in requests}
    for span in range(max(len(spans) for spans in schedules.values())):
        due: dict[int, list] = {}
        for request in requests:
            spans = schedules[request.sample_id]
            if request.sample_id not in live or span >= len(spans):
                continue
            budget = spans[span + 1][0] if span + 1 < len(spans) else request.max_new_tokens
            continued = replace(request, generated_ids=done[request.sample_id], max_new_tokens=budget)
            due.setdefault(spans[span][1], []).append(continued)
        for version in sorted(due):
            load_version(version)
            for request, result in zip(due[version], engine.generate(due[version])):
                done[request.sample_id] = list(result.token_ids)  # the prefix and what followed
                if result.finish_reason != "length" or span + 1 >= len(schedules[request.sample_id]):
                    live.discard(request.sample_id)
    return done


def compare_with_uninterrupted(run_dir: Path, base: Path, config_path: Path, steps: int) -> dict:
    """Lost, duplicated and identical samples of every step, against in-process generation from the
    versions that generated them; the largest version lag of a trained token."""
    from safetensors.torch import load_file

    from infra.run.config import load_config
    from rl.engine import HFEngine
    from rl.models import load_model
    from rl.prompt_source import PromptSource
    from rl.rollout import build_requests, read_samples

    config = load_config(config_path)
    model, tokenizer = load_model(base)
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch_size=64, device="cpu")
    base_state = {k: v.clone() for k, v in model.state_dict().items()}

    def load_version(version: int) -> None:
        if engine.policy_version == version:
            return
        path = run_dir / "checkpoints" / f"step_{version:06d}" / "model.safetensors"
        engine.load_weights(base_state if version == 0 else load_file(path), version)

    prompts = PromptSource(config.data)
    lost = duplicated = identical = total = matching = positions = worst_lag = 0
    for step in range(1, steps + 1):
        records = prompts.take((step - 1) * PROMPTS, PROMPTS)
        requests = build_requests(tokenizer, records, step, config.rollout, config.run.seed, config.prompt)
        samples = read_samples(run_dir / "steps" / f"{step:06d}" / "rollout.jsonl")
        schedules = {r.sample_id: [(0, step - 1)] for r in requests}
        for sample in samples:
            versions = sample.versions()
            spans = [(i, v) for i, v in enumerate(versions) if i == 0 or versions[i - 1] != v]
            schedules[sample.sample_id] = spans or [(0, step - 1)]
            worst_lag = max([worst_lag, *((step - 1) - v for v in versions)])
        expected = regenerate(engine, load_version, requests, schedules)
        ids = Counter(s.sample_id for s in samples)
        duplicated += sum(n - 1 for n in ids.values())
        lost += len(set(expected) - set(ids))
        for sample in samples:
            want = expected[sample.sample_id]
            identical += sample.response_ids == want
            matching += sum(a == b for a, b in zip(sample.response_ids, want))
            positions += max(len(want), len(sample.response_ids))
            total += 1
    return {
        "samples_lost": lost,
        "samples_duplicated": duplicated,
        "responses_identical_fraction": identical / max(total, 1),
        "token_match_rate": matching / max(positions, 1),
        "max_version_lag": worst_lag,
    }


_PULL_LINE = re.compile(
    r"loaded policy version \d+ \((?:weights|adapters): (\d+) bytes, (\d+) of deltas; (\d+) whole-version fallbacks\)"
)


def weight_pulls(run_dir: Path) -> dict:
    """What the instances' logs say about their weight pulls: how many, how many came as deltas,
    how many fell back to a whole version, and the bytes received."""
    pulls = [m.groups() for log in run_dir.rglob("*.log") for m in _PULL_LINE.finditer(log.read_text(errors="replace"))]
    return {
        "weight_pulls": len(pulls),
        "weight_pulls_by_delta": sum(1 for _, delta, _ in pulls if int(delta) > 0),
        "weight_full_fallbacks": sum(int(fallbacks) for *_, fallbacks in pulls),
        "weight_mb_pulled": round(sum(int(nbytes) for nbytes, _, _ in pulls) / 2**20, 2),
    }


def instances_replaced(run_dir: Path) -> int:
    """Failed instances the steps' tables counted as replaced (`replaced` of each step's metrics)."""
    rows = [json.loads(path.read_text()) for path in run_dir.glob("steps/*/metrics.json")]
    return sum(row.get("replaced", 0) for row in rows)


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown fault kinds {unknown}: choose from {', '.join(KINDS)}")
    return kinds


def ledger_state(ledger_url: str, run_id: str) -> tuple[int, int]:
    """(open instances of the run, steps counted more than once)."""
    from sqlalchemy import func, select
    from sqlalchemy.orm import Session

    from infra.ledger.models import Instance, Step
    from infra.ledger.recorder import Ledger

    with Ledger(ledger_url) as ledger, Session(ledger.engine) as session:
        open_instances = session.scalar(
            select(func.count())
            .select_from(Instance)
            .where(Instance.run_id == run_id, Instance.terminated_at.is_(None))
        )
        steps = [row.step for row in session.scalars(select(Step).where(Step.run_id == run_id))]
    return open_instances, len(steps) - len(set(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="The run's steps: enough for every fault kind to land.")
    parser.add_argument("--mean-gap-s", type=float, default=4.0, help="Mean time between two faults.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument(
        "--upload-cap-mb-s",
        type=float,
        default=0.03,
        help="Each weight server's upload cap: a version's delta (~80 KB) takes about 2.7 s, so faults land in pulls.",
    )
    parser.add_argument("--max-attempts", type=int, default=20, help="Drivers run before giving up.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--staleness", type=int, default=0, help="training.max_staleness (K) of the run.")
    parser.add_argument("--keep", type=Path, help="Work in this directory and keep it (default: a temporary one).")
    parser.add_argument(
        "--faults",
        type=_kinds,
        default=DEFAULT_KINDS,
        help=f"Comma-separated fault kinds to inject, each at least once (default: {','.join(DEFAULT_KINDS)}; "
        f"also: {','.join(k for k in KINDS if k not in DEFAULT_KINDS)}).",
    )
    args = parser.parse_args()

    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from rl.models import TinyLlamaShape, build_tiny_llama, save_model

    work = args.keep or Path(tempfile.mkdtemp(prefix="rlboost-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    model, tokenizer = build_tiny_llama(
        TinyLlamaShape(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128), seed=0
    )
    save_model(model, tokenizer, base)
    ledger_url = f"sqlite:///{work / 'ledger.sqlite'}"
    began = time.monotonic()
    chaos = Chaos(args, work)
    try:
        with prefect_test_harness(server_startup_timeout=120):
            env = chaos.environment(
                {**os.environ, env_vars.LEDGER_URL: ledger_url, "PREFECT_API_URL": PREFECT_API_URL.value()}
            )
            config = chaos.config(base)
            threads = [
                threading.Thread(target=chaos.supervise, args=(config, env)),
                threading.Thread(target=chaos.track, daemon=True),
                threading.Thread(target=chaos.inject, daemon=True),
            ]
            if chaos.rendezvous is not None:
                threads.append(threading.Thread(target=chaos.operate_node, args=(env,)))
            for thread in threads:
                thread.start()
            threads[0].join()
            if chaos.rendezvous is not None:
                threads[-1].join()
        minutes = (time.monotonic() - began) / 60
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(pid, t) for pid, t in chaos.started):
            time.sleep(0.5)
        orphans = {pid: cmd for (pid, t), cmd in chaos.started.items() if _alive(pid, t)}
        for pid in orphans:
            _signal(pid, signal.SIGKILL)
        run_id = chaos.run_id()
        completed = chaos.exit_codes[-1:] == [0]
        identity = compare_with_uninterrupted(chaos.run_dir, base, config, args.steps) if completed else {}
        open_instances, steps_twice = ledger_state(ledger_url, run_id) if run_id else (None, None)
    finally:
        chaos.redis.stop()
    if orphans:
        print(f"orphans: {orphans}", flush=True)
    result = {
        "steps": args.steps if completed else None,
        "faults": {kind: chaos.faults[kind] for kind in KINDS},
        "samples_lost": identity.get("samples_lost"),
        "samples_duplicated": None if not identity else identity["samples_duplicated"] + steps_twice,
        "responses_identical_fraction": identity.get("responses_identical_fraction"),
        "token_match_rate": identity.get("token_match_rate"),
        "orphans_left": len(orphans),
        "open_ledger_instances": open_instances,
        "instances_replaced": instances_replaced(chaos.run_dir),
        "minutes": round(minutes, 2),
        "staleness": args.staleness,
        "max_version_lag": identity.get("max_version_lag"),
        "driver_attempts": chaos.attempts,
        "driver_exit_codes": chaos.exit_codes,
        **({"trainer_node_exit_codes": chaos.node_exit_codes} if chaos.rendezvous else {}),
        "worker_signals": dict(chaos.signals),
        **weight_pulls(chaos.run_dir),
        "work_dir": str(work),
    }
    print(json.dumps(result))
    missed = [kind for kind in args.faults if not chaos.faults[kind]]
    if missed:  # a run too short for its faults is no evidence that they are survived
        print(
            f"the run ended before every fault kind was injected (none of: {', '.join(missed)}); "
            f"run more --steps (this run: {args.steps})",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
