"""The Kafka connection every client of the process uses: address, security, client properties.

A production cluster needs more than a bootstrap address: SASL (PLAIN, SCRAM,
OAUTHBEARER), TLS (CA, client certificate) and other client properties. They are
given once, as Kafka users know them, in librdkafka's property names:

- a properties file, ``TRAJBUS_KAFKA_CONFIG=client.properties`` (Java properties:
  ``key=value`` lines, ``#`` comments, ``\\`` continuations), or ``--kafka-config FILE``;
- environment variables ``TRAJBUS_KAFKA_<PROPERTY>``, the name upper-cased with
  ``_`` for ``.`` (``TRAJBUS_KAFKA_SASL_PASSWORD`` is ``sasl.password``), which
  override the file; ``--kafka-property KEY=VALUE`` overrides both (the CLI puts
  it in the environment, so the services it starts inherit it);
- code: ``configure({...})``.

``clients.client_config`` turns it into a confluent-kafka producer, consumer or admin
configuration; ``faust_credentials`` into the worker's aiokafka credentials.
Checked before anything connects (``KafkaConfigError``: the CLI's exit 2), and
secrets never reach logs, ``/statistics`` or exceptions (``redacted``).
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import javaproperties

CONFIG_FILE_VAR = "TRAJBUS_KAFKA_CONFIG"
ENV_PREFIX = "TRAJBUS_KAFKA_"
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")
SECRET_WORDS = ("password", "secret", "jaas", "token", "key.pem", "credentials")
FILE_PROPERTIES = ("ssl.ca.location", "ssl.certificate.location", "ssl.key.location")

_configured: dict[str, str] | None = None


class KafkaConfigError(ValueError):
    """The connection settings are malformed or incomplete (named in the message, secrets left out)."""


def read_properties_file(path: str | Path) -> dict[str, str]:
    """A Java properties file, read as Java reads it (``javaproperties``): ``key=value``, ``key: value``
    or ``key value``; ``#`` and ``!`` comments; a value continued on the next line after ``\\``;
    ``\\uXXXX`` escapes. A hand-written reader split continued values into bogus keys."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KafkaConfigError(f"kafka config: cannot read {path} ({getattr(exc, 'strerror', None) or exc})") from None
    return {key.strip(): value.strip() for key, value in javaproperties.loads(text).items()}


def from_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The properties of the file in ``TRAJBUS_KAFKA_CONFIG``, overridden by ``TRAJBUS_KAFKA_*`` variables."""
    environ = os.environ if environ is None else environ
    properties = read_properties_file(environ[CONFIG_FILE_VAR]) if environ.get(CONFIG_FILE_VAR) else {}
    for name, value in environ.items():
        if name.startswith(ENV_PREFIX) and name != CONFIG_FILE_VAR:
            properties[name[len(ENV_PREFIX):].lower().replace("_", ".")] = value
    return validate(properties)


def validate(properties: dict[str, str]) -> dict[str, str]:
    protocol = properties.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise KafkaConfigError(f"security.protocol: unknown protocol {properties['security.protocol']!r} "
                               f"(expected one of {', '.join(PROTOCOLS)})")
    if protocol.startswith("SASL"):
        mechanism = properties.get("sasl.mechanism", properties.get("sasl.mechanisms", "GSSAPI")).upper()
        if mechanism not in MECHANISMS:
            raise KafkaConfigError(f"sasl.mechanism: unknown mechanism {mechanism!r} "
                                   f"(expected one of {', '.join(MECHANISMS)})")
        if mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            for needed in ("sasl.username", "sasl.password"):
                if not properties.get(needed):
                    raise KafkaConfigError(f"{needed}: missing, and security.protocol {protocol} with "
                                           f"sasl.mechanism {mechanism} needs it")
    elif "sasl.mechanism" in properties or "sasl.username" in properties:
        raise KafkaConfigError(f"sasl.mechanism: given, but security.protocol is {protocol} (SASL_PLAINTEXT or "
                               "SASL_SSL use it)")
    for name in FILE_PROPERTIES:
        if name in properties and not Path(properties[name]).is_file():
            raise KafkaConfigError(f"{name}: no such file {properties[name]!r}")
    return properties


def configure(properties: dict[str, str] | None) -> None:
    """Set this process's connection properties from code (None: read the environment again)."""
    global _configured
    _configured = None if properties is None else validate(dict(properties))


def connection_properties() -> dict[str, str]:
    """The security and client properties every client of this process adds to its own settings."""
    global _configured
    if _configured is None:
        _configured = from_environment()
    return dict(_configured)


@dataclass(frozen=True)
class KafkaConnection:
    """One cluster as every client of this process reaches it: the bootstrap list and the security and
    client properties (file, ``TRAJBUS_KAFKA_*``, flags). ``infra.clients`` builds each role's client
    from it; its repr hides secrets, so it may be logged."""

    bootstrap_servers: str
    properties: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, bootstrap_servers: "str | KafkaConnection") -> "KafkaConnection":
        """This process's connection to ``bootstrap_servers`` (a connection is taken as it is)."""
        if isinstance(bootstrap_servers, KafkaConnection):
            return bootstrap_servers
        return cls(bootstrap_servers, MappingProxyType(connection_properties()))

    def librdkafka(self) -> dict[str, Any]:
        """The connection as librdkafka properties."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.properties}

    def __repr__(self) -> str:
        return f"KafkaConnection({self.bootstrap_servers!r}, {redacted(dict(self.properties))!r})"


def error_words(exc: BaseException) -> str:
    """What a failure says: a ``KafkaException``'s error text (``Failed to get metadata: Local: Broker
    transport failure``), not the ``KafkaError{code=...}`` repr its ``str`` gives."""
    from confluent_kafka import KafkaError, KafkaException

    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return error.str() if isinstance(error, KafkaError) else str(exc)


def redacted(properties: dict[str, Any]) -> dict[str, Any]:
    """The properties fit for a log line or ``/statistics``: secrets replaced by ``***``."""
    return {key: "***" if any(word in key.lower() for word in SECRET_WORDS) else value
            for key, value in properties.items()}


def _ssl_context(properties: Mapping[str, str]) -> ssl.SSLContext | None:
    """The TLS context the librdkafka properties describe (None without TLS), for the pure-Python clients."""
    if not properties.get("security.protocol", "PLAINTEXT").upper().endswith("SSL"):
        return None
    context = ssl.create_default_context(cafile=properties.get("ssl.ca.location"))
    if properties.get("ssl.certificate.location"):
        context.load_cert_chain(properties["ssl.certificate.location"], properties.get("ssl.key.location"),
                                properties.get("ssl.key.password"))
    if properties.get("ssl.endpoint.identification.algorithm", "https").lower() == "none":
        context.check_hostname = False
    return context


def _sasl_mechanism(properties: Mapping[str, str], client: str) -> str:
    mechanism = properties.get("sasl.mechanism", properties.get("sasl.mechanisms", "GSSAPI")).upper()
    if mechanism not in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
        raise KafkaConfigError(f"sasl.mechanism: {client} supports PLAIN and SCRAM here, not {mechanism}")
    return mechanism


def faust_credentials(properties: dict[str, str] | None = None) -> Any:
    """aiokafka credentials for the Faust worker (None for PLAINTEXT)."""
    import faust

    properties = connection_properties() if properties is None else properties
    context = _ssl_context(properties)
    if not properties.get("security.protocol", "PLAINTEXT").upper().startswith("SASL"):
        return faust.SSLCredentials(context) if context is not None else None
    return faust.SASLCredentials(username=properties["sasl.username"], password=properties["sasl.password"],
                                 mechanism=_sasl_mechanism(properties, "the worker (aiokafka)"), ssl_context=context)


def kafka_python_settings(properties: dict[str, str] | None = None) -> dict[str, Any]:
    """The connection as ``kafka-python`` client arguments (``security_protocol``, TLS context, SASL)."""
    properties = connection_properties() if properties is None else properties
    protocol = properties.get("security.protocol", "PLAINTEXT").upper()
    settings: dict[str, Any] = {"security_protocol": protocol, "ssl_context": _ssl_context(properties)}
    if protocol.startswith("SASL"):
        settings.update(sasl_mechanism=_sasl_mechanism(properties, "kafka-python"),
                        sasl_plain_username=properties["sasl.username"],
                        sasl_plain_password=properties["sasl.password"])
    return settings


def _property(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (a librdkafka property), got {text.split('=')[0]!r}")
    return key.strip(), value


def add_connection_arguments(parser: argparse.ArgumentParser,
                             bootstrap_help: str = "Kafka bootstrap servers (HOST:PORT[,HOST:PORT])") -> None:
    """``--bootstrap-servers``, ``--kafka-config`` and ``--kafka-property``: every command's way to the cluster."""
    parser.add_argument("--bootstrap-servers", help=bootstrap_help)
    parser.add_argument("--kafka-config", metavar="FILE",
                        help=f"client properties file (security, TLS, SASL; librdkafka names); also ${CONFIG_FILE_VAR}")
    parser.add_argument("--kafka-property", type=_property, action="append", metavar="KEY=VALUE",
                        help=f"one client property, e.g. security.protocol=SASL_SSL (repeatable); also "
                             f"${ENV_PREFIX}<KEY> with _ for .")


def apply_connection_arguments(args: argparse.Namespace) -> None:
    """Put the flags in the environment (the services a command starts inherit them) and check the result;
    ``KafkaConfigError`` names what is wrong before anything connects."""
    if getattr(args, "kafka_config", None):
        os.environ[CONFIG_FILE_VAR] = args.kafka_config
    for key, value in getattr(args, "kafka_property", None) or []:
        os.environ[ENV_PREFIX + key.upper().replace(".", "_")] = value
    configure(None)
    connection_properties()
