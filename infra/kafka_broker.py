"""The embedded single-node Apache Kafka broker (KRaft mode) on loopback.

The broker is the real Apache Kafka server: its jars are fetched from Maven
Central with ``mvn`` into a cache directory outside the repository, its storage
is formatted once, and it runs as a detached JVM so that it outlives the command
that started it (``trajbus broker up``) until ``trajbus broker down``.

Production users never touch this module: they pass ``--bootstrap-servers`` (or
set ``TRAJBUS_BOOTSTRAP_SERVERS``) and point trajbus at their own cluster.

``secure=True`` (``trajbus broker up --secure``) serves clients on a SASL/PLAIN
over TLS listener only, as a managed cluster would; the credentials and the CA to
trust are written to ``client.properties`` in the state directory
(``TRAJBUS_KAFKA_CONFIG`` takes it; ``infra.broker_credentials``).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from trajbus.infra.broker_credentials import client_credentials, client_credentials_file
from trajbus.infra.local import free_port, pid_alive, port_is_free, reap
from trajbus.infra.paths import default_state_dir, trajbus_cache_dir
from trajbus.infra.tls import ensure_tls_files

log = logging.getLogger(__name__)

KAFKA_VERSION = "3.9.1"
"""The newest 3.x: KRaft is complete, and it still accepts the older protocol
versions that 4.0 removed (KIP-896), which keeps every Python client here safe."""

HOST = "127.0.0.1"
TLS_HOSTS = [HOST, "localhost"]
"""Names the secure broker's certificate is valid for."""

# Broker settings sized for one node on a small machine. Retention checks run
# every few seconds so that the retention bounds on `groups` topics (trajbus's
# backpressure) are enforced promptly rather than every 5 minutes.
_BROKER_PROPERTIES = {
    "process.roles": "broker,controller",
    "node.id": "1",
    "controller.listener.names": "CONTROLLER",
    "inter.broker.listener.name": "PLAINTEXT",
    "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    "auto.create.topics.enable": "false",
    "num.partitions": "1",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "8",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "8",
    "group.initial.rebalance.delay.ms": "0",
    "log.retention.check.interval.ms": "5000",
    "message.max.bytes": str(64 * 1024 * 1024),
    "replica.fetch.max.bytes": str(64 * 1024 * 1024),
    "num.network.threads": "2",
    "num.io.threads": "4",
}


JVM_OPTIONS_VARIABLE = "TRAJBUS_BROKER_JVM_OPTIONS"
SERVER_JVM_OPTIONS = "-XX:+UseG1GC"
"""The broker's JVM options unless ``TRAJBUS_BROKER_JVM_OPTIONS`` names others: G1, as Kafka's own scripts."""
SHORT_LIVED_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""For brokers that live seconds to minutes on a small machine (the test session sets them): the quick
compiler only and one collector thread. A node starts on about a third less CPU and serves a test's load on
about a third less, with the same Kafka behind it."""

PORT_WAIT = 10.0
"""Seconds a restarted broker waits for its previous ports before it takes new ones."""


class BrokerError(RuntimeError):
    """The embedded broker could not be installed, started or stopped."""


@dataclass(frozen=True)
class ClusterNode:
    """One node's place in an embedded cluster (``infra.kafka_cluster``): its id and ports, the quorum
    it votes in, the cluster id its storage is formatted with, and the cluster-wide broker settings."""

    node_id: int
    port: int
    controller_port: int
    voters: str
    cluster_id: str
    properties: dict[str, str]


@dataclass
class BrokerState:
    """What a running embedded broker left on disk for other processes to find."""

    pid: int
    host: str
    port: int
    controller_port: int
    version: str
    data_dir: str
    log_file: str
    client_properties: str | None = None
    """A secure broker's client properties file (SASL credentials); None: plaintext."""

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 (it may start with "-")."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


class EmbeddedKafka:
    """Install, start, probe and stop one single-node KRaft broker.

    ``state_dir`` holds the data directory, the generated configuration, the log
    and ``state.json`` (how other processes find the running broker).
    ``cache_dir`` holds the downloaded jars, shared by every state directory.
    """

    def __init__(
        self,
        state_dir: Path | str | None = None,
        cache_dir: Path | str | None = None,
        version: str = KAFKA_VERSION,
        heap: str = "768m",
        secure: bool = False,
        node: ClusterNode | None = None,
        jvm_options: str | None = None,
    ) -> None:
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.cache_dir = Path(cache_dir) if cache_dir else trajbus_cache_dir()
        self.version = version
        self.heap = heap
        self.secure = secure
        self.node = node
        """Set when this broker is one node of an embedded cluster; None: a single node."""
        self.jvm_options = shlex.split(jvm_options or os.environ.get(JVM_OPTIONS_VARIABLE, SERVER_JVM_OPTIONS))
        """``jvm_options``, else ``TRAJBUS_BROKER_JVM_OPTIONS``, else ``SERVER_JVM_OPTIONS``."""

    # -- paths -------------------------------------------------------------
    @property
    def label(self) -> str:
        where = f"node {self.node.node_id} of a cluster" if self.node else "single node"
        return f"Apache Kafka {self.version} (KRaft, {where})"

    @property
    def libs_dir(self) -> Path:
        return self.cache_dir / "kafka" / self.version / "libs"

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "broker.log"

    # -- install -------------------------------------------------------------
    def is_installed(self) -> bool:
        return (self.libs_dir / f"kafka_2.13-{self.version}.jar").exists()

    def install(self) -> Path:
        """Fetch the broker jars from Maven Central once; later calls are free."""
        if self.is_installed():
            return self.libs_dir
        for tool in ("java", "mvn"):
            if shutil.which(tool) is None:
                raise BrokerError(
                    f"`{tool}` is not on PATH: the embedded Apache Kafka broker needs "
                    "Java 17+ and Maven, or pass --bootstrap-servers to use an existing cluster"
                )
        self.libs_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="libs-", dir=self.libs_dir.parent))
        pom = resources.files("trajbus.infra").joinpath("kafka/pom.xml").read_text()
        (staging / "pom.xml").write_text(pom.replace("${kafka.version}", self.version))
        log.info("fetching Apache Kafka %s from Maven Central into %s", self.version, self.libs_dir)
        cmd = [
            "mvn", "-B", "-q", "-f", str(staging / "pom.xml"),
            "dependency:copy-dependencies", "-DincludeScope=runtime",
            f"-DoutputDirectory={staging / 'libs'}",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise BrokerError(
                f"mvn could not fetch Apache Kafka {self.version}:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
        # Rename is atomic: a concurrent or interrupted install never leaves half a libs dir.
        try:
            (staging / "libs").rename(self.libs_dir)
        except OSError:
            if not self.is_installed():
                raise
        shutil.rmtree(staging, ignore_errors=True)
        return self.libs_dir

    # -- state ---------------------------------------------------------------
    def read_state(self) -> BrokerState | None:
        try:
            return BrokerState(**json.loads(self.state_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def status(self) -> BrokerState | None:
        """The running broker's state, or None (a stale state file is removed)."""
        state = self.read_state()
        if state is None:
            return None
        if not pid_alive(state.pid):
            self.state_file.unlink(missing_ok=True)
            return None
        return state

    # -- start / stop --------------------------------------------------------
    def _java_command(self, *args: str) -> list[str]:
        log4j = self.state_dir / "log4j.properties"
        return [
            "java", f"-Xmx{self.heap}", "-Xms128m",
            *self.jvm_options,
            "-Djava.awt.headless=true", f"-Dlog4j.configuration=file:{log4j}",
            "-cp", str(self.libs_dir / "*"), *args,
        ]

    def _write_config(self, port: int, controller_port: int) -> Path:
        props = dict(_BROKER_PROPERTIES)
        if self.node is not None:
            props.update({**self.node.properties, "node.id": str(self.node.node_id)})
        props.update({
            "controller.quorum.voters": self.node.voters if self.node else f"1@{HOST}:{controller_port}",
            "listeners": f"PLAINTEXT://{HOST}:{port},CONTROLLER://{HOST}:{controller_port}",
            "advertised.listeners": f"PLAINTEXT://{HOST}:{port}",
            "log.dirs": str(self.data_dir),
        })
        if self.secure:  # clients: SASL/PLAIN over TLS only; the node talks to itself on a loopback listener
            internal = free_port()
            credentials = client_credentials(self.state_dir, TLS_HOSTS)
            user, password = credentials["sasl.username"], credentials["sasl.password"]
            props.update({
                "listeners": f"SASL_SSL://{HOST}:{port},INTERNAL://{HOST}:{internal},"
                             f"CONTROLLER://{HOST}:{controller_port}",
                "advertised.listeners": f"SASL_SSL://{HOST}:{port},INTERNAL://{HOST}:{internal}",
                "inter.broker.listener.name": "INTERNAL",
                "listener.security.protocol.map": "SASL_SSL:SASL_SSL,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
                "ssl.keystore.type": "PEM",
                "ssl.keystore.location": str(ensure_tls_files(self.state_dir, TLS_HOSTS).broker_keystore),
                "sasl.enabled.mechanisms": "PLAIN",
                "listener.name.sasl_ssl.plain.sasl.jaas.config":
                    "org.apache.kafka.common.security.plain.PlainLoginModule required "
                    f'username="{user}" password="{password}" user_{user}="{password}";',
            })
        config = self.state_dir / "server.properties"
        config.write_text("".join(f"{key}={value}\n" for key, value in props.items()))
        log4j = resources.files("trajbus.infra").joinpath("kafka/log4j.properties").read_text()
        (self.state_dir / "log4j.properties").write_text(log4j)
        return config

    def _choose_ports(self) -> tuple[int, int]:
        """Reuse the ports of the previous run when free, so clients keep their address (a cluster's
        node always has its own: the quorum and the bootstrap list name them)."""
        if self.node is not None:
            return self.node.port, self.node.controller_port
        previous = self.state_dir / "ports.json"
        try:
            ports = json.loads(previous.read_text())
        except (OSError, ValueError):
            ports = {}
        deadline = time.monotonic() + PORT_WAIT
        while "port" in ports:  # a moment for the previous run's sockets to go
            if port_is_free(ports["port"]) and port_is_free(ports["controller_port"]):
                return ports["port"], ports["controller_port"]
            if time.monotonic() > deadline:
                log.warning("ports %d/%d of the previous run are taken: the broker moves, and its clients "
                            "need its new address", ports["port"], ports["controller_port"])
                break
            time.sleep(0.2)
        port, controller_port = free_port(), free_port()
        while controller_port == port:
            controller_port = free_port()
        previous.write_text(json.dumps({"port": port, "controller_port": controller_port}))
        return port, controller_port

    def _format_storage(self, config: Path) -> None:
        if (self.data_dir / "meta.properties").exists():
            return
        cluster_id = self.node.cluster_id if self.node else new_cluster_id()
        result = subprocess.run(
            self._java_command("kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(config)),
            capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise BrokerError(f"formatting Kafka storage failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")

    def start(self, fresh: bool = False, timeout: float = 90.0) -> BrokerState:
        """Start the broker (or return the one already running) and wait until it serves."""
        running = self.status()
        if running is not None:
            return running
        self.install()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if fresh and self.data_dir.exists():
            shutil.rmtree(self.data_dir)
        port, controller_port = self._choose_ports()
        with open(self.log_file, "ab") as out:
            process = subprocess.Popen(
                self._server_command(port, controller_port),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # outlives `trajbus broker up`; Ctrl-C there does not kill it
            )
        state = BrokerState(
            pid=process.pid, host=HOST, port=port, controller_port=controller_port,
            version=self.version, data_dir=str(self.data_dir), log_file=str(self.log_file),
            client_properties=str(client_credentials_file(self.state_dir)) if self.secure else None,
        )
        self.state_file.write_text(json.dumps(asdict(state)))
        try:
            self._wait_ready(process, state, timeout)
        except BaseException:
            self.stop()
            raise
        log.info("kafka broker ready at %s (pid %d)", state.bootstrap_servers, state.pid)
        return state

    def _server_command(self, port: int, controller_port: int) -> list[str]:
        """The broker process to launch (its storage formatted first)."""
        config = self._write_config(port, controller_port)
        self._format_storage(config)
        return self._java_command("kafka.Kafka", str(config))

    def _wait_ready(self, process: subprocess.Popen, state: BrokerState, timeout: float) -> None:
        """Ready means a real client got cluster metadata back, not that a port opened."""
        from trajbus.infra import clients
        from trajbus.infra.kafka_config import KafkaConnection

        credentials = client_credentials(self.state_dir, TLS_HOSTS) if self.secure else {}
        # This broker's own connection, not the process's; its start-up errors are not the process's
        # authentication failures, so the shared error callback is left out.
        admin = clients.admin(KafkaConnection(state.bootstrap_servers, credentials), {
            "log_level": 0, "logger": logging.getLogger("infra.kafka_broker.probe"), "error_cb": lambda _error: None})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise BrokerError(f"kafka broker exited with {process.returncode}:\n{self._log_tail()}")
            try:
                if admin.list_topics(timeout=1.0).brokers:
                    return
            except Exception:  # noqa: BLE001 - not up yet; the deadline bounds the wait
                pass
            time.sleep(0.2)
        raise BrokerError(f"kafka broker not ready after {timeout:.0f}s:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no broker log)"

    def stop(self, timeout: float = 60.0) -> BrokerState | None:
        """Stop the broker with a controlled shutdown; SIGKILL only past the timeout. Returns the state of
        the broker it stopped (``trajbus broker down`` names it), None when none was running."""
        state = self.read_state()
        if state is None:
            return None
        stopped = None
        if pid_alive(state.pid):
            os.kill(state.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while pid_alive(state.pid) and time.monotonic() < deadline:
                reap(state.pid)
                time.sleep(0.1)
            if pid_alive(state.pid):
                log.warning("kafka broker did not stop in %.0fs; killing it", timeout)
                os.kill(state.pid, signal.SIGKILL)
            reap(state.pid)
            stopped = state
        self.state_file.unlink(missing_ok=True)
        return stopped
