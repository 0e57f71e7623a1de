"""`PeerClient` against a real HTTP server that closes each connection after its response
(`Connection: close`, what a peer server stopping on its SIGTERM answers): the whole body comes
back, and a body cut short is a `SourceFailed`, never an error that stops the worker (it once read
its timeout from a connection that had already let go of its socket: an `AttributeError`)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from infra.weights.config import WeightsConfig
from infra.weights.peer_client import PeerClient, SourceFailed
from tests.helpers import PEER_SECRET

BODY = b"chunk" * 1000


class Closing(http.server.BaseHTTPRequestHandler):
    """200 with `Connection: close`; under `/short/`, a body cut short before the connection closes."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(BODY[: len(BODY) // 2] if self.path.startswith("/short/") else BODY)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Closing)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_response_that_closes_its_connection_is_read_whole_or_fails_as_a_source(server):
    client = PeerClient(PEER_SECRET.encode(), WeightsConfig())
    try:
        assert client.get(server, "/weights/v1/chunk-0", {}) == BODY
        assert client.get(server, "/weights/v1/chunk-1", {}) == BODY  # a new connection for the next
        with pytest.raises(SourceFailed, match=f"connection closed after {len(BODY) // 2} of {len(BODY)} bytes"):
            client.get(server, "/short/weights/v1/chunk-2", {})
    finally:
        client.close()
