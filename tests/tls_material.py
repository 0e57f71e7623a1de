"""TLS material for tests: a CA and certificates it signs, made with the `cryptography` package,
and a real `redis-server` that accepts TLS only (`--port 0 --tls-port P`).

* `make_ca(directory)`: a CA's certificate and key (`ca.pem`, `ca.key`);
* `issue(ca, directory, name, hosts)`: a certificate for `hosts` (DNS names or IP addresses) that
  the CA signs (`<name>.pem`, `<name>.key`);
* `tls_redis(directory)`: a context manager running redis-server with TLS on a free loopback
  port, a password and no persistence; yields its rediss:// URL and the CA file.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from infra.services.ports import free_port
from infra.services.redis_embedded import find_redis_server


@dataclass(frozen=True)
class Issuer:
    cert: Path
    key: Path


def _write(directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issuer:
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return Issuer(cert_path, key_path)


def _builder(subject: str, issuer: x509.Name | None, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def make_ca(directory: Path, name: str = "ca") -> Issuer:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(f"rlboost test {name}", None, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _write(directory, name, cert, key)


def issue(ca: Issuer, directory: Path, name: str, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Issuer:
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        _builder(name, ca_cert.subject, key.public_key())
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _write(directory, name, cert, key)


@dataclass(frozen=True)
class TlsRedis:
    url: str
    """rediss://:<password>@127.0.0.1:<port>/0"""
    plaintext_url: str
    """The same server, host and port as redis:// (which it must refuse)."""
    ca_file: Path


@contextmanager
def tls_redis(directory: Path) -> Iterator[TlsRedis]:
    """A redis-server that speaks TLS only, signed by a fresh CA under `directory`."""
    ca = make_ca(directory)
    server = issue(ca, directory, "redis")
    port, password = free_port(), secrets.token_hex(16)
    config = directory / "redis.conf"
    config.write_text(
        "\n".join(
            [
                "port 0",
                f"tls-port {port}",
                "bind 127.0.0.1",
                f"tls-cert-file {server.cert}",
                f"tls-key-file {server.key}",
                f"tls-ca-cert-file {ca.cert}",
                "tls-auth-clients no",  # clients authenticate with the password; TLS authenticates the server
                f"requirepass {password}",
                'save ""',
                "appendonly no",
                f"dir {directory}",
            ]
        )
        + "\n"
    )
    process = subprocess.Popen([find_redis_server(), str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if process.poll() is not None:
                    raise RuntimeError(f"redis-server with TLS exited: {process.stderr.read().decode()}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("redis-server with TLS did not listen") from None
                time.sleep(0.05)
        yield TlsRedis(f"rediss://:{password}@127.0.0.1:{port}/0", f"redis://:{password}@127.0.0.1:{port}/0", ca.cert)
    finally:
        process.terminate()
        process.wait(timeout=10)
