"""Throwaway X.509 material for the security tests: a CA, a server cert for 127.0.0.1, client certs.

Made with the ``cryptography`` package (a test dependency); keys are EC P-256, valid for a day.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


class CA:
    """A self-signed certificate authority that issues server and client certificates."""

    def __init__(self, directory: Path, name: str = "elaswave-test-ca") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._subject = subject
        self._cert = (
            _builder(subject, subject, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = self.dir / f"{name}.pem"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, common_name: str, *, server: bool = False) -> Pair:
        """A certificate for ``common_name`` (client auth; plus server auth for 127.0.0.1)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = _builder(subject, self._subject, key.public_key())
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
        cert = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False).sign(
            self._key, hashes.SHA256()
        )
        pair = Pair(self.dir / f"{common_name}.pem", self.dir / f"{common_name}-key.pem")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        pair.key.chmod(0o600)
        return pair


def _builder(subject: x509.Name, issuer: x509.Name, public_key: object) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
