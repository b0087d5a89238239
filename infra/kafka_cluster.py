"""An embedded Apache Kafka cluster on loopback: N KRaft nodes, each a broker and a controller.

The way to try failover on one machine: kill a node for good, restart the nodes one by
one as an upgrade does, move leaders. Each node is an ``EmbeddedKafka`` with its own
state directory (``node1``, ``node2``, ...) under the cluster's, the same jars, and a
few hundred MB of heap. The cluster is configured as managed clusters are, so that
trajbus meets what its users run:

- ``default.replication.factor`` = min(3, N) and ``min.insync.replicas`` = min(2, N),
  for topics and for Kafka's own (consumer offsets, transaction state);
- ``cluster.json`` in the state directory keeps the cluster id and every node's ports,
  so a node restarted later comes back on the same address and joins the same quorum.
"""

from __future__ import annotations

import json
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trajbus.infra.kafka_broker import (HOST, KAFKA_VERSION, BrokerError, BrokerState, ClusterNode, EmbeddedKafka,
                                        new_cluster_id)
from trajbus.infra.local import free_port
from trajbus.infra.paths import default_state_dir

log = logging.getLogger(__name__)

MAX_NODES = 9
LAYOUT_FILE = "cluster.json"


def cluster_properties(nodes: int) -> dict[str, str]:
    """What a managed cluster of ``nodes`` brokers sets: replicated topics, internal topics included."""
    replicas, in_sync = str(min(3, nodes)), str(min(2, nodes))
    return {
        "default.replication.factor": replicas,
        "min.insync.replicas": in_sync,
        "offsets.topic.replication.factor": replicas,
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": in_sync,
    }


@dataclass
class ClusterState:
    """The cluster's address (every node, running or not) and the nodes that run now."""

    bootstrap_servers: str
    running: list[BrokerState]
    nodes: int

    @property
    def version(self) -> str:
        return self.running[0].version if self.running else KAFKA_VERSION


class EmbeddedCluster:
    """Install, start, probe and stop an embedded cluster of ``nodes`` KRaft nodes."""

    def __init__(self, state_dir: Path | str | None = None, nodes: int = 3, heap: str = "384m",
                 cache_dir: Path | str | None = None) -> None:
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"--nodes: {nodes} is out of range (1 to {MAX_NODES})")
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.size, self.heap, self.cache_dir = nodes, heap, cache_dir

    @property
    def label(self) -> str:
        return f"Apache Kafka {KAFKA_VERSION} (KRaft, {self.size} nodes)"

    @property
    def layout_file(self) -> Path:
        return self.state_dir / LAYOUT_FILE

    def _layout(self, fresh: bool = False) -> dict:
        """The cluster id and each node's ports: made once, then kept so nodes keep their addresses."""
        if not fresh and self.layout_file.exists():
            layout = json.loads(self.layout_file.read_text())
            if len(layout["nodes"]) != self.size:
                raise BrokerError(f"the embedded cluster in {self.state_dir} has {len(layout['nodes'])} nodes, "
                                  f"not {self.size}: start it with --nodes {len(layout['nodes'])}, or --fresh")
            return layout
        ports: set[int] = set()
        while len(ports) < 2 * self.size:
            ports.add(free_port())
        ordered = sorted(ports)
        layout = {"cluster_id": new_cluster_id(),
                  "nodes": [{"node_id": i + 1, "port": ordered[2 * i], "controller_port": ordered[2 * i + 1]}
                            for i in range(self.size)]}
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.layout_file.write_text(json.dumps(layout))
        return layout

    def nodes(self, fresh: bool = False) -> list[EmbeddedKafka]:
        """Every node, running or not, in node-id order."""
        layout = self._layout(fresh)
        voters = ",".join(f"{n['node_id']}@{HOST}:{n['controller_port']}" for n in layout["nodes"])
        properties = cluster_properties(self.size)
        return [EmbeddedKafka(state_dir=self.state_dir / f"node{n['node_id']}", cache_dir=self.cache_dir,
                              heap=self.heap,
                              node=ClusterNode(n["node_id"], n["port"], n["controller_port"], voters,
                                               layout["cluster_id"], properties))
                for n in layout["nodes"]]

    def node(self, node_id: int) -> EmbeddedKafka:
        return self.nodes()[node_id - 1]

    def bootstrap_servers(self) -> str:
        return ",".join(f"{HOST}:{n['port']}" for n in self._layout()["nodes"])

    def is_installed(self) -> bool:
        return EmbeddedKafka(cache_dir=self.cache_dir).is_installed()

    def install(self) -> Path:
        return EmbeddedKafka(cache_dir=self.cache_dir).install()

    def start(self, fresh: bool = False, timeout: float = 120.0) -> ClusterState:
        """Start every node that is not running (a quorum forms only once most of them are up, so
        they start together) and wait until each serves."""
        self.install()
        nodes = self.nodes(fresh=fresh)
        if fresh:
            for node in nodes:
                node.stop()
                shutil.rmtree(node.state_dir, ignore_errors=True)
        with ThreadPoolExecutor(len(nodes), thread_name_prefix="kafka-node") as pool:
            starts = [pool.submit(node.start, False, timeout) for node in nodes]
            errors = [future.exception() for future in starts]
        failed = [error for error in errors if error is not None]
        if failed:
            self.stop()
            raise BrokerError(f"the embedded cluster did not start: {failed[0]}")
        state = self.status()
        assert state is not None
        log.info("kafka cluster ready at %s (%d nodes)", state.bootstrap_servers, len(state.running))
        return state

    def status(self) -> ClusterState | None:
        """The cluster's state while at least one node runs, else None."""
        if not self.layout_file.exists():
            return None
        running = [state for state in (node.status() for node in self.nodes()) if state is not None]
        return ClusterState(self.bootstrap_servers(), running, self.size) if running else None

    def stop(self) -> list[tuple[EmbeddedKafka, BrokerState]]:
        """Stop every node (controlled shutdown, in parallel: the last ones need their quorum); returns the
        nodes that were running, each with the state it ran with (empty: none was)."""
        if not self.layout_file.exists():
            return []
        nodes = self.nodes()
        with ThreadPoolExecutor(len(nodes), thread_name_prefix="kafka-node") as pool:
            states = list(pool.map(EmbeddedKafka.stop, nodes))
        return [(node, state) for node, state in zip(nodes, states) if state is not None]


def layout_size(state_dir: Path | str | None = None) -> int | None:
    """How many nodes the embedded cluster set up in ``state_dir`` has (None: no cluster there)."""
    path = (Path(state_dir) if state_dir else default_state_dir()) / LAYOUT_FILE
    try:
        return len(json.loads(path.read_text())["nodes"])
    except (OSError, ValueError, KeyError):
        return None
