"""HTTPS between weight peers (`weights.tls`): the run's peer certificate and how each side uses it.

A run has one peer certificate: a self-signed EC key pair that the trainer generates when the run
starts (`PeerCertificate.generate`) unless the environment already holds one, and that reaches
every instance the way the weights secret does, through the environment (`CERT_ENV`, `KEY_ENV`,
PEM text; a Prefect Secret block for VMs). Every peer server presents it and every peer client
trusts exactly it, so a connection succeeds only to a holder of the run's key, with any address:
instances are reached by the IP their VM got, which no certificate could name in advance, so the
host name is not checked (the pinned certificate is the identity). Requests stay HMAC-signed
(`infra.weights.auth`); TLS adds the encryption of the bytes, and of the signatures, on the wire.
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rl import env_vars

CERT_ENV = env_vars.WEIGHTS_TLS_CERT
KEY_ENV = env_vars.WEIGHTS_TLS_KEY
VALID_DAYS = 30
"""Validity of a generated certificate: longer than any run, short enough not to matter if it leaks."""


@dataclass(frozen=True)
class PeerCertificate:
    cert_pem: str
    key_pem: str

    @classmethod
    def generate(cls) -> PeerCertificate:
        """A fresh self-signed certificate and key (EC P-256)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlboost weights peer")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))  # a VM whose clock is a little behind
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(
            cert.public_bytes(serialization.Encoding.PEM).decode(),
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ).decode(),
        )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> PeerCertificate:
        """The run's certificate from `CERT_ENV` / `KEY_ENV` of `environ` (this process's environment
        by default); `ValueError` naming them if unset."""
        cert, key = environ.get(CERT_ENV, ""), environ.get(KEY_ENV, "")
        if "BEGIN CERTIFICATE" not in cert or "PRIVATE KEY" not in key:
            raise ValueError(
                f"weights.tls: the peer endpoints use HTTPS, but the environment lacks the run's peer "
                f"certificate ({CERT_ENV} and {KEY_ENV}, PEM): the trainer sets them for its instances; "
                f"an instance started by hand needs the trainer's values, or turn off weights.tls"
            )
        return cls(cert, key)

    def environment(self) -> dict[str, str]:
        """The variables that hand this certificate to another process."""
        return {CERT_ENV: self.cert_pem, KEY_ENV: self.key_pem}

    @contextmanager
    def server_files(self) -> Iterator[tuple[Path, Path]]:
        """(certificate, key) as files readable by this user only, for the block (uvicorn reads files)."""
        with tempfile.TemporaryDirectory(prefix="rlboost-peer-tls-") as directory:  # mode 0700
            cert, key = Path(directory) / "cert.pem", Path(directory) / "key.pem"
            cert.write_text(self.cert_pem)
            key.touch(mode=0o600)
            key.write_text(self.key_pem)
            yield cert, key

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts this certificate only, whatever address it is reached at."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=self.cert_pem)
        context.check_hostname = False  # the pinned certificate is the identity (see the module docstring)
        context.verify_mode = ssl.CERT_REQUIRED
        return context
