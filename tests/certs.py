"""Certificates made at test time with ``cryptography``: a CA and the certificates it signs.

Keys are EC P-256 (fast to make); every leaf certificate may serve and authenticate as a client,
as tandem's services do both with the same pair.
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


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class CA:
    """A certificate authority whose files live in ``folder``: ``ca.pem``, and a pair per ``issue``."""

    def __init__(self, folder: Path, name: str = "tandem test CA") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self._name = _name(name)
        self._cert = (
            x509.CertificateBuilder().subject_name(self._name).issuer_name(self._name)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.pem = folder / "ca.pem"
        self.pem.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, stem: str, *names: str) -> Pair:
        """A certificate for ``names`` (DNS names or IP addresses; default localhost and 127.0.0.1)."""
        names = names or ("localhost", "127.0.0.1")
        alt: list[x509.GeneralName] = []
        for name in names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                alt.append(x509.DNSName(name))
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder().subject_name(_name(names[0])).issuer_name(self._name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        pair = Pair(self.folder / f"{stem}.pem", self.folder / f"{stem}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(_pem_key(key))
        pair.key.chmod(0o600)
        return pair
