"""This machine's ports and processes, for the services trajbus starts on loopback (brokers,
cluster nodes, workers, gateways, test servers): one place, not one copy per caller."""

from __future__ import annotations

import os
import socket

import psutil

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
