"""`PeerClient`: signed GETs against peer servers, for the puller's fetch threads.

Each thread keeps one keep-alive `http.client` connection per server. A request either returns the
whole body of a 200 response or raises:

* `SourceBusy` on 503 (all the server's upload slots are taken; ask again, nothing is wrong);
* `SourceLacks` (a `SourceFailed`) on a 404 that says the server does not hold that chunk yet (a
  partial holder: ask elsewhere, nothing is wrong with the server);
* `SourceFailed` on anything else, with the reason: connection refused or reset, an HTTP error
  (401, 404, ...), a body cut short, or a slow source: no response within `queue_timeout_s +
  chunk_timeout_s` (time to wait for an upload slot, then to start sending), or a body not complete
  `chunk_timeout_s` after its first byte.

A connection the server closed while idle (keep-alive timeout) is replaced once, transparently.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from urllib.parse import urlsplit

from infra.weights.auth import authorization
from infra.weights.config import WeightsConfig
from infra.weights.peer_server import NOT_HELD_HEADER
from infra.weights.tls import PeerCertificate

_READ_BYTES = 1 << 20


class SourceBusy(Exception):
    """The source answered 503: all its upload slots are taken."""


class SourceFailed(Exception):
    """The source could not deliver (the message says why)."""


class SourceLacks(SourceFailed):
    """The source serves the version but does not hold this chunk yet."""


class PeerClient:
    def __init__(self, secret: bytes, config: WeightsConfig, tls: PeerCertificate | None = None) -> None:
        """`tls`: the run's peer certificate, the only one an https:// source may present."""
        self.secret = secret
        self._tls_context = tls.client_context() if tls else None
        self.connect_timeout_s = config.chunk_timeout_s
        self.response_timeout_s = config.queue_timeout_s + config.chunk_timeout_s
        self.body_timeout_s = config.chunk_timeout_s
        self._local = threading.local()
        self._open: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()

    def _pool(self) -> dict[str, http.client.HTTPConnection]:
        return self._local.__dict__.setdefault("pool", {})

    def _connection(self, base_url: str) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to `base_url`, and whether it is new."""
        pool = self._pool()
        if base_url in pool:
            return pool[base_url], False
        parts = urlsplit(base_url)
        if parts.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname, parts.port, timeout=self.connect_timeout_s, context=self._tls_context
            )
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.connect_timeout_s)
        pool[base_url] = conn
        with self._lock:
            self._open.add(conn)
        return conn, True

    def _drop(self, base_url: str) -> None:
        conn = self._pool().pop(base_url, None)
        if conn is not None:
            conn.close()
            with self._lock:
                self._open.discard(conn)

    def get(self, base_url: str, path: str, headers: dict[str, str]) -> bytes:
        """The body of a 200 response to a signed GET of `base_url` + `path`."""
        for _ in range(2):
            conn, fresh = self._connection(base_url)
            try:
                conn.request("GET", path, headers={**headers, "Authorization": authorization(self.secret, "GET", path)})
                sock = conn.sock  # the response reads it even once the connection let go of it (`Connection: close`)
                sock.settimeout(self.response_timeout_s)
                response = conn.getresponse()
            except (BrokenPipeError, ConnectionResetError) as exc:  # incl. http.client.RemoteDisconnected
                self._drop(base_url)
                if fresh:
                    raise SourceFailed(f"{type(exc).__name__}: {exc}") from exc
                continue  # the server had closed this idle keep-alive connection: once more, anew
            except TimeoutError as exc:
                self._drop(base_url)
                raise SourceFailed("slow: timed out before the response") from exc
            except (OSError, http.client.HTTPException) as exc:
                self._drop(base_url)
                raise SourceFailed(f"{type(exc).__name__}: {exc}") from exc
            return self._body(base_url, sock, response)
        raise SourceFailed("connection closed twice before a response")

    def _body(self, base_url: str, sock: socket.socket, response: http.client.HTTPResponse) -> bytes:
        try:
            if response.status != 200:
                response.read()
                if response.status == 503:
                    raise SourceBusy()
                if response.status == 404 and response.getheader(NOT_HELD_HEADER):
                    raise SourceLacks("not held yet")
                raise SourceFailed(f"HTTP {response.status}")
            length = int(response.getheader("content-length", "-1"))
            if length < 0:
                raise SourceFailed("response without content-length")
            body = bytearray(length)
            view = memoryview(body)
            received = 0
            deadline = time.monotonic() + self.body_timeout_s
            while received < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError()
                sock.settimeout(left)
                n = response.readinto(view[received : received + _READ_BYTES])
                if not n:
                    raise SourceFailed(f"connection closed after {received} of {length} bytes")
                received += n
            return bytes(body)
        except (SourceBusy, SourceLacks):
            raise  # the whole body was read: the connection stays usable
        except SourceFailed:
            self._drop(base_url)
            raise
        except TimeoutError as exc:
            self._drop(base_url)
            raise SourceFailed(f"slow: body not received within {self.body_timeout_s:.1f} s") from exc
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self._drop(base_url)
            raise SourceFailed(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Close every connection (call once the fetch threads are done)."""
        with self._lock:
            connections, self._open = self._open, set()
        for conn in connections:
            conn.close()
