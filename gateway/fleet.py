"""``trajbus gateway --instances N``: N gateway processes on one host, one door, sharing only Kafka.

The supervisor binds every socket and forks the instances, so the sockets
outlive any one of them:

- the door (``--port``) is shared: the kernel hands each connection to one
  instance, so any instance answers ``/init_trajectory``;
- instance ``i`` also listens on ``--port + 1 + i`` alone; its base_urls name that
  port, so an agent's calls reach the instance that holds its trajectory's state
  (``--state-dir/instance-i``).

An instance that dies (SIGKILL, an outage past the limit) is forked again with
the same sockets, id and state: connections its agents open meanwhile wait in
the socket's queue and are answered by the new process (503 with Retry-After
until it is ready), so they continue token-consistently; the other instances
notice nothing. SIGTERM or SIGINT stops every instance gracefully.

What an instance runs is given to the fleet: ``gateway.server`` owns running one
instance and hands its ``serve`` over for ``--instances N``, so the fleet needs
nothing of the server.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import signal
import socket
import sys
import threading
import time
from multiprocessing.process import BaseProcess
from typing import Callable

from trajbus.gateway.config import EXIT_USAGE, GatewaySettings

log = logging.getLogger("trajbus.gateway")

BACKLOG = 4096
"""Connections a socket queues while its instance is busy or being restarted: as many agents as one instance
serves by default (``--max-concurrent-calls``) may connect at once. Linux queues at most
``net.core.somaxconn`` (4096 by default)."""
STOP_SECONDS = 30.0
"""What an instance may take to close after its drain (``--drain-delay`` + ``--drain-timeout``) before it is killed."""
QUICK_EXIT_SECONDS = 30.0
"""An instance that ends sooner than this after its start is restarted with a growing delay."""

ServeInstance = Callable[[GatewaySettings, list[socket.socket]], int]
"""One instance's server: its settings and the sockets the fleet bound in, its exit status out."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening socket the forked instances inherit (the event loop makes it non-blocking)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    return sock


def _run_instance(serve: ServeInstance, settings: GatewaySettings, sockets: list[socket.socket]) -> None:
    """The forked instance: serve on the door and its own socket until told to stop."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # uvicorn installs its own once serving
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(serve(settings, sockets))


class GatewayFleet:
    """Binds the sockets, forks the instances, restarts one that dies, stops them all on a signal.
    ``serve`` is what each instance runs (``gateway.server.serve``, which owns running one)."""

    def __init__(self, settings: GatewaySettings, serve: ServeInstance) -> None:
        if settings.instances > 1 and settings.public_url and not any(
                key in settings.public_url for key in ("{instance}", "{port}")):
            raise ValueError("--public-url must name {port} or {instance} with --instances > 1: each "
                             "instance's base_urls must lead back to it")
        self.settings, self.serve = settings, serve
        self.door = listening_socket(settings.host, settings.port)
        door_port = self.door.getsockname()[1]
        self.own = [listening_socket(settings.host, door_port + 1 + i if settings.port else 0)
                    for i in range(settings.instances)]
        self.instances = [self._instance_settings(i) for i in range(settings.instances)]
        self._context = multiprocessing.get_context("fork")
        self._processes: list[BaseProcess | None] = [None] * settings.instances
        self._started = [0.0] * settings.instances
        self._quick_exits = [0] * settings.instances
        self._stop = threading.Event()

    def _instance_settings(self, index: int) -> GatewaySettings:
        port = self.own[index].getsockname()[1]
        return dataclasses.replace(self.settings, port=port, instances=1,
                                   state_dir=self.settings.state_dir / f"instance-{index}",
                                   instance_id=f"{self.settings.instance}-{index}")

    def _start(self, index: int) -> None:
        process = self._context.Process(target=_run_instance, name=f"gateway-{index}",
                                        args=(self.serve, self.instances[index], [self.door, self.own[index]]))
        process.start()
        self._processes[index], self._started[index] = process, time.monotonic()
        log.info("gateway instance started index=%d pid=%d url=%s", index, process.pid,
                 self.instances[index].base_address)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; 2 when an instance refuses its settings (a bad flag, a tokenizer that does
        not load: every instance would, so none is forked again)."""
        previous = {sig: signal.signal(sig, lambda *_: self._stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for index in range(len(self.instances)):
                self._start(index)
            log.info("gateway fleet serving door=%s:%d instances=%d", self.settings.host,
                     self.door.getsockname()[1], len(self.instances))
            while not self._stop.wait(0.2):
                for index, process in enumerate(self._processes):
                    if process is not None and not process.is_alive():
                        if process.exitcode == EXIT_USAGE:  # a usage error: every instance would refuse it
                            log.error("gateway instance %d refused its settings (exit %d, why above); stopping",
                                      index, EXIT_USAGE)
                            return EXIT_USAGE
                        self._restart(index, process.exitcode)
            return 0
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _restart(self, index: int, exitcode: int | None) -> None:
        lived = time.monotonic() - self._started[index]
        self._quick_exits[index] = self._quick_exits[index] + 1 if lived < QUICK_EXIT_SECONDS else 0
        delay = min(10.0, 0.5 * (2 ** self._quick_exits[index] - 1))
        log.warning("gateway instance exited index=%d code=%s after=%.1fs; restarting in %.1fs", index, exitcode,
                    lived, delay)
        if not self._stop.wait(delay):
            self._start(index)

    def _stop_all(self) -> None:
        running = [p for p in self._processes if p is not None and p.is_alive()]
        for process in running:
            process.terminate()  # SIGTERM: uvicorn's graceful shutdown, producer flushed
        limit = self.settings.drain_delay + self.settings.drain_timeout + STOP_SECONDS
        deadline = time.monotonic() + limit
        for process in running:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("gateway instance pid=%d did not stop in %.0fs; killed", process.pid, limit)
                process.kill()
                process.join()
        for sock in [self.door, *self.own]:
            sock.close()
        log.info("gateway fleet stopped")
