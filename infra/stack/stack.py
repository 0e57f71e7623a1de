"""`rlboost up` / `rlboost down`: everything a user needs to use Prefect for real, on loopback.

`up()` starts, each in its own process group logging under the state directory (`.rlboost/stack/`):
1. a Prefect server on 127.0.0.1 (SQLite in the state directory, or PostgreSQL given a URL), waited
   for through `/api/health`; on another interface (`host`, for cloud VMs) it requires basic auth
   with a credential generated once into `<state dir>/prefect-auth` (0600) that every client sends;
2. a Redis for the runs' token logs (random password; an append-only file fsynced once a second
   unless `redis_appendfsync` says otherwise, so a restarted Redis keeps the token logs);
3. the work pools (base job template `deployments/work-pools/local-process.json`), the zombie-run
   automation (`deployments/automations/`) and the deployments of `prefect.yaml`, then the
   automation that runs `rl-eval/checkpoint` on each `rlboost.checkpoint.saved` event;
4. a Prefect worker (`infra.services.prefect_worker`) per queue training deployments use (the
   `reserved` pool's `default`: the training machine), the Redis URL in its environment.
`stack.json` (private: the Redis password) records what started, so `down()` stops exactly those
(workers, then Redis and the server); a second `up()` is refused. Detail: docs/prefect.md.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import yaml
from pydantic import BaseModel

from infra.fleet.prefect_local import UnknownPool
from infra.run.config import load_config
from infra.services import prefect_worker
from infra.services.ports import free_port, port_is_free
from infra.services.prefect_home import database_problem, point_at_home, sqlite_path
from infra.services.prefect_seed import seed_database
from infra.services.redis_embedded import REDIS_URL_ENV, AppendFsync, find_redis_server, launch_redis_server
from infra.stack.processes import ServiceProcess, log_tail, start_detached, stop

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
PROJECT_FILE = ROOT / "prefect.yaml"
WORK_POOL_TEMPLATE = ROOT / "deployments" / "work-pools" / "local-process.json"
ZOMBIE_AUTOMATION = ROOT / "deployments" / "automations" / "crash-zombie-flow-runs.yaml"
EVAL_AUTOMATION = ROOT / "deployments" / "automations" / "eval-on-checkpoint.yaml"
EVAL_DEPLOYMENT = "rl-eval/checkpoint"
"""The deployment `EVAL_AUTOMATION` runs on each `rlboost.checkpoint.saved` event."""
DEFAULT_STATE_DIR = ROOT / ".rlboost" / "stack"
ROLLOUT_ENTRYPOINT = "flows/rollout_instance.py:rollout_instance"
ROLLOUT_MODULE_ENTRYPOINT = "flows.rollout_instance.rollout_instance"
"""The entrypoint of cloud pools' deployments: a VM has the project installed, not this checkout."""
DEFAULT_PORT = 4200
QUIET_PREFECT = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

Echo = Callable[[str], None]


class StackError(RuntimeError):
    """The stack could not be started or used; the message says what, where and how to fix it."""


class StackInputError(StackError):
    """An argument the stack cannot start with (checked before anything starts)."""


class StackAlreadyUp(StackError):
    """`up()` while the processes of an earlier `up()` are still running."""


class StackState(BaseModel):
    """What `up()` started (`<state_dir>/stack.json`)."""

    state_dir: Path
    api_url: str
    ui_url: str
    database: str
    """The server's database URL, password masked."""
    redis_url: str
    host: str = "127.0.0.1"
    """The interface the Prefect server listens on."""
    auth_file: Path | None = None
    """The file holding the server's basic-auth credential (`user:password`); None: no auth (loopback)."""
    work_pools: list[str] = []
    automation: str | None = None
    deployments: list[str] = []
    workers: list[str] = []
    processes: list[ServiceProcess] = []

    @staticmethod
    def path(state_dir: Path) -> Path:
        return Path(state_dir) / "stack.json"

    def save(self) -> None:
        path = self.path(self.state_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(self.model_dump_json(indent=2))
        temporary.chmod(0o600)  # it holds the Redis password
        temporary.replace(path)

    @classmethod
    def load(cls, state_dir: Path) -> StackState | None:
        path = cls.path(state_dir)
        if not path.exists():
            return None
        return cls.model_validate_json(path.read_text())

    def running(self) -> list[ServiceProcess]:
        return [p for p in self.processes if p.members()]


@dataclass(frozen=True)
class ProjectDeployment:
    """One deployment of prefect.yaml, as far as the stack needs it."""

    name: str
    entrypoint: str
    work_pool: str
    work_queue: str
    own_pull: bool = False
    """The deployment has pull steps of its own (instead of the project's, which enter this checkout)."""

    @property
    def is_rollout_instance(self) -> bool:
        return self.entrypoint in (ROLLOUT_ENTRYPOINT, ROLLOUT_MODULE_ENTRYPOINT)


def read_project(path: Path = PROJECT_FILE) -> list[ProjectDeployment]:
    project = yaml.safe_load(path.read_text())
    return [
        ProjectDeployment(
            d["name"],
            d["entrypoint"],
            d["work_pool"]["name"],
            d["work_pool"].get("work_queue_name") or "default",
            own_pull=bool(d.get("pull")),
        )
        for d in project["deployments"]
    ]


def check_pools(config_path: Path | None, deployments: list[ProjectDeployment]) -> list[str]:
    """The pools of a run configuration; `UnknownPool` for one prefect.yaml cannot run (no
    `rollout-instance` deployment on its work pool; for a cloud pool, one that would look for
    this checkout on the VM)."""
    pools = load_config(config_path).fabric.pools
    deployed = {d.work_pool: d for d in deployments if d.is_rollout_instance}
    where = config_path or "the demo configuration"
    cloud_fix = (
        f"`entrypoint: {ROLLOUT_MODULE_ENTRYPOINT}` (the VM has the project installed) and its own "
        "`pull: [{prefect.deployments.steps.set_working_directory: {directory: /opt/rlboost}}]`"
    )
    for pool in pools:
        deployment = deployed.get(pool.name)
        if deployment is None:
            entrypoint = ROLLOUT_ENTRYPOINT if pool.provider == "local" else ROLLOUT_MODULE_ENTRYPOINT
            raise UnknownPool(
                f"unknown pool {pool.name!r} (in {where}): prefect.yaml has no rollout-instance deployment on work pool "
                f"{pool.name!r} (it has: {', '.join(sorted(deployed)) or 'none'}); add `- name: {pool.name}` with "
                f"`entrypoint: {entrypoint}` and `work_pool: {{name: {pool.name}}}` to prefect.yaml"
                + ("" if pool.provider == "local" else f", plus {cloud_fix}")
            )
        if pool.provider != "local" and (deployment.entrypoint != ROLLOUT_MODULE_ENTRYPOINT or not deployment.own_pull):
            raise UnknownPool(
                f"pool {pool.name!r} (in {where}) runs on {pool.provider} VMs, but its deployment rollout-instance/"
                f"{deployment.name} would look for this checkout there; give it {cloud_fix}"
            )
    return [pool.name for pool in pools]


WILDCARD_HOSTS = ("0.0.0.0", "::")
AUTH_FILE = "prefect-auth"
AUTH_USER = "rlboost"


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only (nobody else can reach a server listening there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def prefect_auth_file(state_dir: Path) -> Path:
    """`<state_dir>/prefect-auth`: the server's basic-auth credential, generated on first use and
    kept (so VM images configured with it stay valid across `up`s), readable by its owner only."""
    path = Path(state_dir) / AUTH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            raise StackError(
                f"{path} holds the Prefect server's credential but others may read it: `chmod 600 {path}` "
                "(and change the credential if they did: delete the file to make a new one)"
            ) from None
        return path
    with os.fdopen(descriptor, "w") as out:
        out.write(f"{AUTH_USER}:{secrets.token_urlsafe(32)}\n")
    return path


def database_url(state_dir: Path, given: str | None) -> str:
    """The server's SQLAlchemy URL: SQLite in the state directory, or the given PostgreSQL URL
    (`postgresql://` and `postgres://` get the asyncpg driver Prefect needs)."""
    if given is None:
        return f"sqlite+aiosqlite:///{(state_dir / 'prefect.db').resolve()}"
    scheme = urlsplit(given).scheme
    if scheme in ("postgresql", "postgres"):
        return "postgresql+asyncpg://" + given.split("://", 1)[1]
    if scheme in ("postgresql+asyncpg", "sqlite+aiosqlite"):
        return given
    raise StackInputError(
        f"--database-url {mask_password(given)}: unsupported scheme {scheme!r}; use "
        "postgresql://user:password@host:5432/database (or omit it for SQLite)"
    )


def mask_password(url: str) -> str:
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class _Starter:
    """Starts the stack's pieces, recording each process in the state file as soon as it runs."""

    def __init__(self, state: StackState, echo: Echo, timeout_s: float) -> None:
        self.state = state
        self.echo = echo
        self.timeout_s = timeout_s
        self.home = state.state_dir / "prefect-home"  # each stack its own, whatever the user's Prefect says
        self.env = {**os.environ, **QUIET_PREFECT}
        point_at_home(self.env, self.home)
        self.auth_string = state.auth_file.read_text().strip() if state.auth_file else None
        if self.auth_string:  # every client process of the stack authenticates
            self.env["PREFECT_API_AUTH_STRING"] = self.auth_string

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(self.state.api_url, auth_string=self.auth_string)

    def launch(self, name: str, command: list[str], env: dict[str, str], cwd: Path | None = None) -> ServiceProcess:
        process = start_detached(name, command, env=env, log=self.state.state_dir / f"{name}.log", cwd=cwd)
        self.state.processes.append(process)
        self.state.save()
        return process

    def server(self, port: int, database: str, given_database: str | None) -> None:
        api = self.state.api_url
        env = {
            **self.env,
            "PREFECT_API_URL": api,
            "PREFECT_UI_API_URL": api,
            "PREFECT_SERVER_API_HOST": self.state.host,
            "PREFECT_SERVER_API_PORT": str(port),
            "PREFECT_API_DATABASE_CONNECTION_URL": database,
            **({"PREFECT_SERVER_API_AUTH_STRING": self.auth_string} if self.auth_string else {}),
        }
        import prefect

        if problem := database_problem(database, prefect.__version__, "use another --state-dir"):
            raise StackError(problem)  # a database of another Prefect version: the server would fail at each start
        self.echo(f"Prefect server: starting on {self.state.ui_url} (database {self.state.database})")
        if (path := sqlite_path(database)) is not None:
            seed_database(path, logger)  # a new database starts migrated: the server skips Prefect's migrations
        started = time.monotonic()
        process = self.launch(
            "server",
            [sys.executable, "-m", "prefect", "server", "start", "--host", self.state.host, "--port", str(port)],
            env,
        )
        while time.monotonic() - started < self.timeout_s:
            if not process.members():
                hint = ""
                if given_database is not None:
                    where = urlsplit(database)
                    hint = (
                        f"; check that PostgreSQL at {where.hostname}:{where.port or 5432} is running and "
                        f"that the database {where.path.lstrip('/')!r} exists and accepts these credentials"
                    )
                raise StackError(
                    f"the Prefect server exited during start-up{hint}. Its log ({process.log}):\n{log_tail(process.log)}"
                )
            try:
                if httpx.get(f"{api}/health", timeout=2.0).status_code == 200:
                    self.echo(f"Prefect server: ready in {time.monotonic() - started:.0f} s")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise StackError(
            f"the Prefect server did not answer {api}/health within {self.timeout_s:.0f} s; "
            f"its log ({process.log}):\n{log_tail(process.log)}"
        )

    def redis(self, appendfsync: AppendFsync | None) -> None:
        binary = find_redis_server()
        directory = self.state.state_dir / "redis"
        directory.mkdir(parents=True, exist_ok=True)
        password = secrets.token_urlsafe(24)
        log = self.state.state_dir / "redis.log"

        def discard(process: ServiceProcess) -> None:
            stop([process], grace_s=2)
            self.state.processes.remove(process)
            self.state.save()

        try:
            started = launch_redis_server(
                lambda command: self.launch("redis", command, self.env),
                lambda process: bool(process.members()),
                discard,
                binary=binary,
                config_dir=directory,
                password=password,
                appendfsync=appendfsync,
                timeout_s=15.0,
            )
        except TimeoutError as exc:
            raise StackError(f"{exc}; its log ({log}):\n{log_tail(log)}") from None
        if started is None:
            raise StackError(
                f"redis-server ({binary}) did not start on a free loopback port in 3 attempts; its log ({log}):\n{log_tail(log)}"
            )
        port = started[1]
        self.state.redis_url = f"redis://:{password}@127.0.0.1:{port}/0"
        self.state.save()
        self.echo(f"Redis: ready on 127.0.0.1:{port}")

    def work_pools_and_automation(self, pools: list[str], zombie_after_s: float | None) -> None:
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.events.schemas.automations import AutomationCore

        template = json.loads(WORK_POOL_TEMPLATE.read_text())
        automation = AutomationCore.model_validate(yaml.safe_load(ZOMBIE_AUTOMATION.read_text()))
        if zombie_after_s is not None:
            automation.trigger.within = timedelta(seconds=zombie_after_s)
        with self.client() as client:
            for pool in pools:
                client.create_work_pool(
                    WorkPoolCreate(name=pool, type="process", base_job_template=template), overwrite=True
                )
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
            client.create_automation(automation)
        self.state.work_pools = pools
        self.state.automation = automation.name
        self.state.save()
        within = automation.trigger.within.total_seconds()
        self.echo(
            f"work pools: {', '.join(pools)} (process; {WORK_POOL_TEMPLATE.relative_to(ROOT)}); "
            f"automation {automation.name!r} (Crashed after {within:.0f} s without a heartbeat)"
        )

    def deploy(self) -> None:
        log = self.state.state_dir / "deploy.log"
        env = {**self.env, "PREFECT_API_URL": self.state.api_url, "PWD": str(ROOT)}
        self.echo("deployments: prefect --no-prompt deploy --all")
        with log.open("ab") as out:
            result = subprocess.run(
                [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=self.timeout_s * 3,
            )
        if result.returncode != 0:
            raise StackError(
                f"`prefect deploy --all` failed (exit {result.returncode}); its output ({log}):\n{log_tail(log)}"
            )
        with self.client() as client:
            flows = {f.id: f.name for f in client.read_flows()}
            self.state.deployments = sorted(f"{flows[d.flow_id]}/{d.name}" for d in client.read_deployments())
        self.state.save()
        self.echo(f"deployments: {', '.join(self.state.deployments)}")

    def eval_automation(self) -> None:
        """Create (or replace) the automation that evaluates each saved checkpoint (`EVAL_AUTOMATION`)."""
        with self.client() as client:
            deployment = client.read_deployment_by_name(EVAL_DEPLOYMENT)
            automation = eval_automation(deployment.id)
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
            client.create_automation(automation)
        self.echo(f"automation {automation.name!r} (runs {EVAL_DEPLOYMENT} on each rlboost.checkpoint.saved)")

    def worker(self, pool: str, queue: str) -> None:
        name = f"rlboost-{pool}-{queue}"
        env = {
            **self.env,
            "PREFECT_API_URL": self.state.api_url,
            REDIS_URL_ENV: self.state.redis_url,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
        }
        process = self.launch(
            f"worker-{pool}-{queue}",
            [
                sys.executable,
                "-m",
                prefect_worker.__name__,
                "--pool",
                pool,
                "--work-queue",
                queue,
                "--name",
                name,
            ],
            env,
            cwd=ROOT,
        )
        started = time.monotonic()
        with self.client() as client:
            while time.monotonic() - started < self.timeout_s:
                if not process.members():
                    raise StackError(
                        f"the worker for pool {pool} exited; its log ({process.log}):\n{log_tail(process.log)}"
                    )
                if any(w.name == name and w.status == "ONLINE" for w in client.read_workers_for_work_pool(pool)):
                    self.state.workers.append(f"{pool}/{queue}")
                    self.state.save()
                    self.echo(f"worker: {name} polls pool {pool!r}, queue {queue!r} (pid {process.pid})")
                    return
                time.sleep(0.5)
        raise StackError(
            f"the worker for pool {pool} did not come online within {self.timeout_s:.0f} s; "
            f"its log ({process.log}):\n{log_tail(process.log)}"
        )


def eval_automation(deployment_id):
    """`EVAL_AUTOMATION` with the `rl-eval/checkpoint` deployment's id filled in (an `AutomationCore`)."""
    from prefect.events.schemas.automations import AutomationCore

    definition = yaml.safe_load(EVAL_AUTOMATION.read_text())
    definition["actions"][0]["deployment_id"] = str(deployment_id)
    return AutomationCore.model_validate(definition)


def up(
    *,
    state_dir: Path = DEFAULT_STATE_DIR,
    port: int | None = None,
    database: str | None = None,
    config_path: Path | None = None,
    zombie_after_s: float | None = None,
    redis_appendfsync: AppendFsync | None = "everysec",
    host: str = "127.0.0.1",
    timeout_s: float = 240.0,
    echo: Echo = print,
) -> StackState:
    """Start the stack (see the module docstring) and return what was started. `redis_appendfsync`:
    when Redis fsyncs its append-only file (None: no persistence). `host`: the Prefect server's
    interface; any but loopback turns on basic auth."""
    state_dir = Path(state_dir).resolve()
    existing = StackState.load(state_dir)
    if existing is not None:
        if existing.running():
            raise StackAlreadyUp(
                f"a stack is already up from {StackState.path(existing.state_dir)} (Prefect API {existing.api_url}, "
                f"{len(existing.running())} process groups running); use it with `export PREFECT_API_URL={existing.api_url}` "
                "or stop it first with `rlboost down`"
            )
        StackState.path(state_dir).unlink()  # a stack that died on its own: nothing left to stop
    deployments = read_project()
    check_pools(config_path, deployments)
    if zombie_after_s is not None and zombie_after_s <= 30:
        raise StackInputError(f"zombie_after_s must exceed the 30 s flow-run heartbeat, got {zombie_after_s:g}")
    # The port is looked at on the address the server binds (on every interface: 127.0.0.1's too).
    if port is not None and not port_is_free(port, host):
        raise StackInputError(f"port {port} on {host} is in use; pick another --port or omit it to use a free one")
    port = port or free_port(host, preferred=DEFAULT_PORT)
    url = database_url(state_dir, database)
    local = "127.0.0.1" if host in WILDCARD_HOSTS or is_loopback(host) else host
    state = StackState(
        state_dir=state_dir,
        api_url=f"http://{local}:{port}/api",
        ui_url=f"http://{local}:{port}",
        database=mask_password(url),
        redis_url="",
        host=host,
        auth_file=None if is_loopback(host) else prefect_auth_file(state_dir),
    )
    starter = _Starter(state, echo, timeout_s)
    try:
        state.save()
        starter.server(port, url, database)
        starter.redis(redis_appendfsync)
        starter.work_pools_and_automation(sorted({d.work_pool for d in deployments}), zombie_after_s)
        starter.deploy()
        starter.eval_automation()
        for pool, queue in sorted({(d.work_pool, d.work_queue) for d in deployments if not d.is_rollout_instance}):
            starter.worker(pool, queue)
    except BaseException:
        down(state_dir, echo=lambda _: None)
        raise
    return state


def down(state_dir: Path = DEFAULT_STATE_DIR, grace_s: float = 60.0, echo: Echo = print) -> StackState | None:
    """Stop exactly what `up()` started (workers first, then Redis and the server); None if no
    stack was recorded in `state_dir`."""
    state = StackState.load(Path(state_dir).resolve())
    if state is None:
        return None
    workers = [p for p in state.processes if p.name.startswith("worker-")]
    services = [p for p in reversed(state.processes) if p not in workers]
    for group in (workers, services):
        for name in stop(group, grace_s):
            echo(f"stopped {name}")
    StackState.path(state.state_dir).unlink(missing_ok=True)
    return state
