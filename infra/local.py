"""This machine's ports and processes, for the services trajbus starts on loopback (brokers,
cluster nodes, workers, gateways, test servers): one place, not one copy per caller."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import psutil

LOOPBACK = "127.0.0.1"
LOWEST_PORT = 10000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections (Linux's default where it does not say)."""
    try:
        low, high = map(int, EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on now, for a server that must come back on the same address.

    Chosen outside the kernel's ephemeral range: while the server is down, clients reconnecting to it
    take ephemeral ports, and one could take the server's own (on loopback a connect to a closed
    port in that range can even connect to itself), so the restarted server could not listen there
    (seen: a broker killed five times came back on another port, and its clients waited for good).
    """
    ephemeral = ephemeral_ports()
    chooser = random.SystemRandom()
    for _ in range(1000):
        port = chooser.randrange(LOWEST_PORT, 65536)
        if port not in ephemeral and port_is_free(port, host):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no luck: the kernel's choice
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(count: int, host: str = LOOPBACK) -> int:
    """The first of ``count`` consecutive free ports (as ``free_port`` chooses them), for a server that
    listens on a block of them (``trajbus gateway --instances``)."""
    ephemeral = ephemeral_ports()
    chooser = random.SystemRandom()
    for _ in range(1000):
        first = chooser.randrange(LOWEST_PORT, 65536 - count)
        block = range(first, first + count)
        if not any(port in ephemeral for port in block) and all(port_is_free(port, host) for port in block):
            return first
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a server could listen on ``port`` now. As the JVM's server socket does, connections of
    an earlier run still in TIME_WAIT do not make the port look taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def pid_alive(pid: int) -> bool:
    """Whether a process runs under ``pid`` (a zombie, dead but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def reap(pid: int) -> None:
    """Collect the exit status when ``pid`` is our own child; nothing otherwise."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
