"""Free TCP ports on this machine: the one place that asks the kernel for one."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1", preferred: int | None = None) -> int:
    """A TCP port on `host` that nothing listens on now: `preferred` when it is free, else one the
    kernel picks. (Free when asked: a caller that binds later can still lose it to another process.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, preferred or 0))
        except OSError:
            if preferred is None:
                raise
            return free_port(host)
        return probe.getsockname()[1]
