"""Free TCP ports on this machine: the one place that probes the kernel for them."""

from __future__ import annotations

import socket


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing holds TCP `port` on `host` now (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", preferred: int | None = None) -> int:
    """A TCP port on `host` that nothing holds now: `preferred` when it is free, else one the
    kernel picks. (Free when asked: a caller that binds later can still lose it to another process.)"""
    if preferred is not None and port_is_free(preferred, host):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
