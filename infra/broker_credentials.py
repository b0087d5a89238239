"""The secure embedded broker's client credentials: its SASL/PLAIN login and the CA to trust.

``trajbus broker up --secure`` serves clients on SASL/PLAIN over TLS only, as a managed
cluster would. What a client needs is made once per state directory and kept there as
``client.properties`` (librdkafka names, readable by its owner only; ``TRAJBUS_KAFKA_CONFIG``
takes it). The broker's own listener accepts the same login, and its readiness probe uses it,
so both ends read this one file and agree across restarts.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from trajbus.infra.tls import ensure_tls_files


def client_credentials_file(state_dir: Path) -> Path:
    """Where a secure broker keeps its clients' properties, in its state directory."""
    return state_dir / "client.properties"


def client_credentials(state_dir: Path, tls_hosts: list[str]) -> dict[str, str]:
    """The secure broker's client properties (credentials, CA), made once per state directory
    (readable by its owner); the CA's certificate is valid for ``tls_hosts``."""
    from trajbus.infra.kafka_config import read_properties_file

    path = client_credentials_file(state_dir)
    tls = ensure_tls_files(state_dir, tls_hosts)
    if not path.exists() or read_properties_file(path).get("security.protocol") != "SASL_SSL":
        password = secrets.token_urlsafe(18)
        path.write_text(f"security.protocol=SASL_SSL\nssl.ca.location={tls.ca_certificate}\n"
                        f"sasl.mechanism=PLAIN\nsasl.username=trajbus\nsasl.password={password}\n")
        path.chmod(0o600)
    return read_properties_file(path)
