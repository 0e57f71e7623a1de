"""`PeerServer`: serves versions held in memory, whole or in part, to other instances over HTTP.

A starlette app on uvicorn in a background thread, on a free port of `bind_host` (HTTPS with `tls`;
every setting is the run's `WeightsConfig`'s): the trainer runs one, and so does every instance.
Routes mirror the store:

    GET /weights/v<version>/manifest.json            the manifest (not rate-limited, no slot)
    GET /weights/v<version>/chunk-00000.safetensors  one chunk's bytes

`offer` serves a complete version; `offer_manifest` starts serving one being pulled, `offer_chunk`
adds each chunk once verified (until then: 404 with `NOT_HELD_HEADER`). `withdraw` stops serving a
version (a bare 404; uploads under way finish). A request without a valid `infra.weights.auth`
signature gets 401 with an empty body. A chunk upload takes one of `max_uploads_per_peer` slots
(`infra.weights.admission`; 503 after `queue_timeout_s`) and stops when its client disconnects;
`upload_cap_mb_s` caps the total upload rate (`infra.weights.bandwidth`). docs/internals.md §6.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import threading
import time
from collections.abc import Mapping
from contextlib import nullcontext

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from infra.weights.admission import Priority, UploadSlots, priority
from infra.weights.auth import SCHEME, is_authorized
from infra.weights.bandwidth import UploadCap
from infra.weights.config import WeightsConfig
from infra.weights.manifest import MANIFEST_FILE, EncodedVersion, Manifest

PROGRESS_HEADER = "x-rlb-progress"
"""Request header: bytes of the version the puller already holds (verified)."""
PULL_STARTED_HEADER = "x-rlb-pull-started"
"""Request header: unix seconds at which the puller started pulling the version."""
NOT_HELD_HEADER = "x-rlb-not-held"
"""Response header of a 404: the server serves the version but does not hold this chunk yet."""
START_TIMEOUT_S = 30.0
"""How long a new server may take to start listening before it is an error."""
_PIECE = 256 * 1024
_EMPTY_HEADERS = [(b"content-length", b"0")]


async def _send_empty(send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _EMPTY_HEADERS + headers})
    await send({"type": "http.response.body", "body": b""})


class _RequireSignature:
    """ASGI middleware: 401 with no body for any request without a valid signature."""

    def __init__(self, app, secret: bytes, max_skew_s: float) -> None:
        self.app = app
        self.secret = secret
        self.max_skew_s = max_skew_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not is_authorized(self.secret, header, scope["method"], scope["path"], self.max_skew_s):
                await _send_empty(send, 401, [(b"www-authenticate", SCHEME.encode())])
                return
        await self.app(scope, receive, send)


class _ChunkUpload:
    """The ASGI response of one chunk: wait for a slot, then stream the bytes under the cap."""

    def __init__(self, served: _Served, index: int, progress: int, pull_started: float, server: PeerServer) -> None:
        self.served = served
        self.index = index
        self.progress = progress
        self.pull_started = pull_started
        self.server = server

    def rank(self) -> Priority:
        return priority(self.served.uploads_begun[self.index], self.progress, self.pull_started)

    async def __call__(self, scope, receive, send) -> None:
        server = self.server
        if not await server.slots.acquire(self.rank, server.queue_timeout_s):
            await _send_empty(send, 503, [(b"retry-after", b"1")])
            return
        self.served.uploads_begun[self.index] += 1
        body = self.served.chunks[self.index]
        upload = asyncio.current_task()
        client_gone = False

        async def stop_when_client_disconnects() -> None:
            nonlocal client_gone
            while (await receive())["type"] != "http.disconnect":
                pass
            client_gone = True
            upload.cancel()

        watcher = asyncio.create_task(stop_when_client_disconnects())
        try:
            headers = [
                (b"content-length", str(len(body)).encode()),
                (b"content-type", b"application/octet-stream"),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            view = memoryview(body)
            for offset in range(0, len(view), _PIECE):
                piece = view[offset : offset + _PIECE]
                if server.cap is not None:
                    await server.cap.take(len(piece))
                server.bytes_sent += len(piece)
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not client_gone:
                raise
        finally:
            watcher.cancel()
            server.slots.release()


class _Served:
    """A version being served: its manifest, the chunks held so far (None: not yet), and how many
    uploads of each chunk have begun (the admission order's first key)."""

    def __init__(self, manifest: Manifest, manifest_bytes: bytes, chunks: list[bytes | None]) -> None:
        self.manifest_bytes = manifest_bytes
        self.files = {info.file: info.index for info in manifest.chunks}
        self.chunks = chunks
        self.uploads_begun = [0] * len(chunks)


class PeerServer:
    def __init__(self, config: WeightsConfig, environ: Mapping[str, str] = os.environ) -> None:
        """Serve with `config`'s secret (from `environ`), address, upload slots and cap, and its
        certificate when `config.tls` (else plain HTTP)."""
        secret, tls, host = config.secret(environ), config.certificate(environ), config.bind_host
        self.slots = UploadSlots(config.max_uploads_per_peer)
        self.cap = UploadCap(config.upload_cap_mb_s * 2**20) if config.upload_cap_mb_s else None
        self.queue_timeout_s = config.queue_timeout_s
        self.bytes_sent = 0
        """Chunk bytes uploaded so far (all versions, all clients)."""
        self._versions: dict[int, _Served] = {}
        self._lock = threading.Lock()
        app = Starlette(
            routes=[Route("/weights/v{version:int}/{name}", self._get)],
            middleware=[Middleware(_RequireSignature, secret=secret, max_skew_s=config.max_clock_skew_s)],
        )
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        port = sock.getsockname()[1]
        advertised = config.advertise_host or host
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://{f'[{advertised}]' if ':' in advertised else advertised}:{port}"
        """Base URL other processes use to reach this server."""
        # uvicorn reads the certificate and key from files while it starts; they are gone once it has.
        with tls.server_files() if tls else nullcontext((None, None)) as (certfile, keyfile):
            config = uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=1,
                ssl_certfile=certfile,
                ssl_keyfile=keyfile,
            )
            self._server = uvicorn.Server(config)
            self._thread = threading.Thread(
                target=self._server.run, kwargs={"sockets": [sock]}, name=f"peer-server-{port}", daemon=True
            )
            self._thread.start()
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self._server.started:
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"peer server on {host}:{port} did not start")
                time.sleep(0.01)

    def offer(self, encoded: EncodedVersion) -> None:
        """Serve this (complete) version from now on (completing it in place if it was being pulled)."""
        with self._lock:
            served = self._versions.get(encoded.version)
            if served is not None and served.manifest_bytes == encoded.manifest_bytes:
                served.chunks[:] = encoded.chunks
            else:
                self._versions[encoded.version] = _Served(
                    encoded.manifest, encoded.manifest_bytes, list(encoded.chunks)
                )

    def offer_manifest(self, manifest: Manifest, manifest_bytes: bytes) -> None:
        """Serve a version being pulled: its (verified) manifest now, its chunks as `offer_chunk` adds them."""
        with self._lock:
            self._versions[manifest.version] = _Served(manifest, manifest_bytes, [None] * len(manifest.chunks))

    def offer_chunk(self, version: int, index: int, data: bytes) -> None:
        """Serve chunk `index` of a version offered by `offer_manifest` (verified against its manifest)."""
        with self._lock:
            served = self._versions.get(version)
            if served is not None:
                served.chunks[index] = data

    def withdraw(self, version: int) -> None:
        with self._lock:
            self._versions.pop(version, None)

    def versions(self) -> list[int]:
        """The versions served whole."""
        with self._lock:
            return sorted(v for v, served in self._versions.items() if None not in served.chunks)

    async def _get(self, request: Request):
        version = request.path_params["version"]
        name = request.path_params["name"]
        with self._lock:
            served = self._versions.get(version)
        if served is None:
            return Response(status_code=404)
        if name == MANIFEST_FILE:
            return Response(served.manifest_bytes, media_type="application/json")
        index = served.files.get(name)
        if index is None:
            return Response(status_code=404)
        if served.chunks[index] is None:
            return Response(status_code=404, headers={NOT_HELD_HEADER: "1"})
        try:
            progress = int(request.headers.get(PROGRESS_HEADER, "0"))
            started = float(request.headers.get(PULL_STARTED_HEADER, "inf"))
        except ValueError:
            return Response(status_code=400)
        if math.isnan(started):
            return Response(status_code=400)
        return _ChunkUpload(served, index, progress, started, self)

    def close(self) -> None:
        """Stop serving (uploads in flight are cut after a one-second grace period)."""
        self._server.should_exit = True
        self._thread.join(timeout=10)
