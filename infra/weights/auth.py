"""Request signing for the peer endpoints: HMAC-SHA256 with the run's shared secret.

A client sends ``Authorization: RLB-HMAC <unix seconds>:<hex signature>``, where the signature is
HMAC-SHA256(secret, ``"<METHOD>\\n<path>\\n<unix seconds>"``). The secret itself never crosses the
network; a captured header is only good for the same method and path within `max_skew_s` of its
timestamp (the endpoints are read-only, so a replay gains nothing new). Verification compares in
constant time and rejects anything malformed.
"""

from __future__ import annotations

import hashlib
import hmac
import time

SCHEME = "RLB-HMAC"


def _signature(secret: bytes, method: str, path: str, timestamp: int) -> str:
    message = f"{method.upper()}\n{path}\n{timestamp}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def authorization(secret: bytes, method: str, path: str, now: float | None = None) -> str:
    """The Authorization header value for one request."""
    timestamp = int(time.time() if now is None else now)
    return f"{SCHEME} {timestamp}:{_signature(secret, method, path, timestamp)}"


def is_authorized(
    secret: bytes, header: str | None, method: str, path: str, max_skew_s: float, now: float | None = None
) -> bool:
    """Whether `header` is a valid, fresh signature of (method, path) under `secret`."""
    if not header:
        return False
    scheme, _, credentials = header.partition(" ")
    timestamp_text, _, signature = credentials.partition(":")
    if scheme != SCHEME or not timestamp_text.isdigit() or len(timestamp_text) > 12:
        return False
    timestamp = int(timestamp_text)
    if abs((time.time() if now is None else now) - timestamp) > max_skew_s:
        return False
    expected = _signature(secret, method, path, timestamp)
    return hmac.compare_digest(expected.encode(), signature.encode("ascii", "replace"))
