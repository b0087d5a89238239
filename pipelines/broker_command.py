"""``trajbus broker up|down|status|install``: the embedded broker, one node or a small cluster.

The last line of ``up`` (and of ``status``) is the bootstrap address, by contract: one
``HOST:PORT``, or the comma-separated list of every node of a cluster.

The command's own lines say what the broker modules log at INFO (fetching, ready at): their
loggers speak from WARNING (a moved port), unless ``trajbus -v`` asks for everything.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from trajbus.infra.kafka_broker import BrokerState, EmbeddedKafka
from trajbus.infra.kafka_cluster import MAX_NODES, EmbeddedCluster, layout_size
from trajbus.infra.tansu_broker import TANSU_VERSION


BROKER_LOGGERS = ("trajbus.infra.kafka_broker", "trajbus.infra.kafka_cluster")
"""The loggers of the brokers this command runs."""


class BrokerUsageError(ValueError):
    """A broker command the user must fix (exit 2)."""


def check_nodes(nodes: int) -> int:
    """``--nodes``: 1 to ``MAX_NODES`` (one line and exit 2 otherwise, as every bad input of the CLI)."""
    if not 1 <= nodes <= MAX_NODES:
        raise BrokerUsageError(f"--nodes: {nodes} is out of range (1 to {MAX_NODES} nodes)")
    return nodes


def add_broker_parser(sub: argparse._SubParsersAction) -> None:
    broker = sub.add_parser("broker", help="the embedded Apache Kafka broker: one node, or a cluster (--nodes)")
    broker.add_argument("action", choices=["up", "down", "status", "install"])
    broker.add_argument("--state-dir", help="where the broker keeps data, log and address "
                                            "(default: $TRAJBUS_STATE_DIR or ~/.cache/trajbus/broker)")
    broker.add_argument("--fresh", action="store_true", help="wipe the data directory before starting")
    broker.add_argument("--nodes", type=int, default=None,
                        help=f"run a cluster of this many KRaft nodes on loopback (2 to {MAX_NODES}; replication "
                             "min(3, N), min.insync.replicas min(2, N)), the way to try failover on one machine")
    broker.add_argument("--secure", action="store_true",
                        help="serve clients on a SASL/PLAIN over TLS listener only (credentials and CA in the state "
                             "directory's client.properties), as a managed cluster does")
    broker.add_argument("--engine", choices=["kafka", "tansu"], default="kafka",
                        help="kafka: Apache Kafka (needs Java); tansu: the pip-only Tansu binary, memory only, "
                             "no retention, no transactions, no timestamp look-ups (default: %(default)s)")
    broker.set_defaults(func=cmd_broker)


def _single(args: argparse.Namespace) -> EmbeddedKafka:
    if args.engine == "tansu":
        from trajbus.infra.tansu_broker import TansuBroker

        if args.secure:
            raise BrokerUsageError("--secure: the Tansu broker has no SASL listener; use --engine kafka")
        return TansuBroker(state_dir=args.state_dir)
    return EmbeddedKafka(state_dir=args.state_dir, secure=args.secure)


def _cluster(args: argparse.Namespace) -> EmbeddedCluster | None:
    """The cluster the command is about: ``--nodes N`` (N > 1), else the one set up in the state directory."""
    nodes = check_nodes(args.nodes) if args.nodes is not None else layout_size(args.state_dir)
    if args.nodes is not None and args.nodes > 1 and (args.engine != "kafka" or args.secure):
        raise BrokerUsageError("--nodes: the embedded cluster is plaintext Apache Kafka (no --secure, no tansu)")
    if args.nodes == 1 or nodes is None or (args.nodes is None and args.action == "up"):
        return None
    return EmbeddedCluster(args.state_dir, nodes)


def cmd_broker(args: argparse.Namespace) -> int:
    if not getattr(args, "verbose", False):
        for name in BROKER_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    cluster = _cluster(args)
    broker = cluster or _single(args)
    if args.action == "install":
        print(f"{broker.label}: {broker.install()}")
        return 0
    if args.action == "up":
        return _up(args, broker)
    if args.action == "down":
        return _down(args, broker)
    state = broker.status()
    if state is None:
        print(f"broker not running (state dir {broker.state_dir})")
        return 1
    if isinstance(broker, EmbeddedCluster):
        print(f"{state.version} cluster: {len(state.running)} of {state.nodes} nodes running "
              f"(node pids {', '.join(str(node.pid) for node in state.running)})")
    else:
        print(f"{state.version} running, pid {state.pid}, data {state.data_dir}")
    print(state.bootstrap_servers)
    return 0


def _down(args: argparse.Namespace, broker: EmbeddedKafka | EmbeddedCluster) -> int:
    """Stop what runs in the state directory and name each broker stopped: which one, its pid, its address
    and its state (so a person sees ``down`` hit the broker they meant); exit 0 also when none ran."""
    stopped: list[tuple[str, Path, BrokerState]] = []
    for node, state in broker.stop() if isinstance(broker, EmbeddedCluster) else ():
        assert node.node is not None, "a cluster's node knows its place"
        stopped.append((f"node {node.node.node_id} of the Kafka cluster", node.state_dir, state))
    # A cluster's directory may also hold a single node left from before: stopped too.
    single = broker if isinstance(broker, EmbeddedKafka) else EmbeddedKafka(state_dir=args.state_dir)
    state = single.stop()
    if state is not None:
        engine = "Tansu" if state.version == TANSU_VERSION else "Kafka"
        stopped.append((f"the {engine} broker", single.state_dir, state))
    for what, where, state in stopped:
        print(f"stopped {what} (pid {state.pid}) at {state.bootstrap_servers}, state in {where}")
    if not stopped:
        print(f"no broker running in {single.state_dir}")
    return 0


def _up(args: argparse.Namespace, broker: EmbeddedKafka | EmbeddedCluster) -> int:
    if isinstance(broker, EmbeddedCluster) and EmbeddedKafka(state_dir=args.state_dir).status() is not None:
        raise BrokerUsageError(f"a single-node broker runs in {broker.state_dir}: `trajbus broker down` first, "
                               "or give the cluster another --state-dir")
    if not broker.is_installed():
        print(f"fetching {broker.label} (once) ...", flush=True)
    if broker.status() is None:
        print(f"starting {broker.label} in {broker.state_dir} ...", flush=True)
    state = broker.start(fresh=args.fresh)
    if isinstance(broker, EmbeddedCluster):
        for node in state.running:
            print(f"{state.version} node at {node.bootstrap_servers}, pid {node.pid}, log {node.log_file}")
    else:
        print(f"{state.version} running, pid {state.pid}, log {state.log_file}")
        if state.client_properties:
            print(f"SASL/PLAIN over TLS only; credentials and CA: "
                  f"export TRAJBUS_KAFKA_CONFIG={state.client_properties}")
    print(state.bootstrap_servers)  # the last line is the address, by contract
    return 0
