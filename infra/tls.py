"""A private certificate authority for the embedded broker's TLS listener (``--secure``).

Managed clusters serve clients over TLS with certificates the client must trust. The
embedded broker does the same with a CA made here, once per state directory: the
broker loads its key and certificate chain as a PEM keystore, and clients trust the
CA through ``ssl.ca.location``, the property a user sets for their own cluster's CA.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

VALID_DAYS = 365


@dataclass(frozen=True)
class TlsFiles:
    ca_certificate: Path
    """What clients trust (``ssl.ca.location``)."""
    broker_keystore: Path
    """The broker's private key and certificate chain, one PEM file (``ssl.keystore.location``)."""


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 signer: ec.EllipticCurvePrivateKey, ca: bool, hosts: list[str]) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signer, hashes.SHA256())


def ensure_tls_files(directory: Path, hosts: list[str]) -> TlsFiles:
    """The CA certificate and the broker's keystore in ``directory``, made on first use (owner-readable)."""
    files = TlsFiles(directory / "ca.pem", directory / "broker-keystore.pem")
    if files.ca_certificate.exists() and files.broker_keystore.exists():
        return files
    ca_key, broker_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trajbus embedded broker CA")])
    ca = _certificate("trajbus embedded broker CA", ca_key, ca_name, ca_key, ca=True, hosts=[])
    broker = _certificate(hosts[0], broker_key, ca_name, ca_key, ca=False, hosts=hosts)
    pem = serialization.Encoding.PEM
    key = broker_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    files.broker_keystore.write_bytes(key + broker.public_bytes(pem) + ca.public_bytes(pem))
    files.broker_keystore.chmod(0o600)
    files.ca_certificate.write_bytes(ca.public_bytes(pem))
    return files
