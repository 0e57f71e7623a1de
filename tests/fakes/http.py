"""The HTTP plumbing every fake shares: a threaded server on a free loopback port, routing by
method and path pattern, JSON replies, a record of every request, and a list of protocol violations.

A *violation* is a request the real service would reject because the client built it wrong (an
unknown path or field, a missing header): the fake answers 400 and records it, and the fixtures fail
the test if any were recorded. Errors the real cloud returns for valid requests (unknown machine
type, no capacity) are modelled answers, not violations.
"""

from __future__ import annotations

import json
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    """One request as the fake received it."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    """Lower-cased names."""
    body: Any
    """Parsed JSON, the raw text of a non-JSON body, or None."""


@dataclass
class Reply:
    status: int = 200
    body: Any = None
    """JSON-serialisable, or a str sent as text/plain."""
    headers: dict[str, str] = field(default_factory=dict)


class Violation(Exception):
    """Raised by a handler: the request is malformed for the real service."""


Handler = Callable[..., Reply]


class FakeServer(ABC):
    """Subclasses register `(method, path regex, handler)` in `routes()`; named groups become
    keyword arguments of the handler, which gets the `Request` first."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.violations: list[str] = []
        self.lock = threading.RLock()
        self._routes = [(method, re.compile(pattern + r"$"), handler) for method, pattern, handler in self.routes()]
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name=type(self).__name__, daemon=True
        )

    @abstractmethod
    def routes(self) -> list[tuple[str, str, Handler]]:
        """(method, path regex, handler) of every endpoint."""

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def requests_to(self, method: str, pattern: str) -> list[Request]:
        """Recorded requests of `method` whose path matches `pattern` (a regex search)."""
        with self.lock:
            return [r for r in self.requests if r.method == method and re.search(pattern, r.path)]

    def _dispatch(self, request: Request) -> Reply:
        with self.lock:
            self.requests.append(request)
        for method, pattern, handler in self._routes:
            match = pattern.match(request.path)
            if method == request.method and match:
                try:
                    return handler(request, **match.groupdict())
                except Violation as violation:
                    return self._violation(f"{request.method} {request.path}: {violation}")
        return self._violation(f"{request.method} {request.path}: no such endpoint")

    def _violation(self, message: str) -> Reply:
        with self.lock:
            self.violations.append(message)
        return Reply(400, {"error": {"code": 400, "message": f"fake: malformed request: {message}"}})

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class _Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                parts = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length).decode() if length else ""
                content_type = self.headers.get("Content-Type", "")
                try:
                    body: Any = json.loads(raw) if raw and "json" in content_type else (raw or None)
                except ValueError:
                    body = raw
                headers = {k.lower(): v for k, v in self.headers.items()}
                reply = fake._dispatch(Request(self.command, parts.path, query, headers, body))
                if isinstance(reply.body, str):
                    data, kind = reply.body.encode(), "text/plain"
                else:
                    data, kind = (b"" if reply.body is None else json.dumps(reply.body).encode()), "application/json"
                self.send_response(reply.status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                for key, value in reply.headers.items():
                    self.send_header(key, value)
                try:
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a killed VM's long poll)
                    pass

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

            def log_message(self, *args: object) -> None:
                pass

        return _Handler


def check_keys(where: str, value: Any, allowed: dict[str, Any]) -> None:
    """Every key of the JSON object `value` is in `allowed`, recursively: an `allowed` value that is
    a dict describes a nested object, a one-item list a list of such objects, None any scalar."""
    if not isinstance(value, dict):
        raise Violation(f"{where}: expected an object, got {type(value).__name__}")
    for key, item in value.items():
        if key not in allowed:
            raise Violation(f"{where}: unknown field {key!r}")
        spec = allowed[key]
        if isinstance(spec, dict) and spec:
            check_keys(f"{where}.{key}", item, spec)
        elif isinstance(spec, list):
            if not isinstance(item, list):
                raise Violation(f"{where}.{key}: expected a list")
            for index, element in enumerate(item):
                check_keys(f"{where}.{key}[{index}]", element, spec[0])
