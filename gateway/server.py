"""Running the gateway: ``python -m gateway`` and ``trajbus gateway`` end here.

Two things uvicorn does on its own are made the gateway's here: the answer to HTTP it cannot parse
(``JsonErrorProtocol``: OpenAI-shaped JSON, not plain text) and SIGTERM (``DrainingServer``: readiness
flips and new calls are refused before the server stops listening, calls in flight are answered,
the producer is flushed, exit 0).
"""

from __future__ import annotations

import argparse
import logging
import resource
import signal
import socket
import sys
import time
from types import FrameType

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from trajbus.gateway import gc_pauses
from trajbus.gateway.config import EXIT_USAGE, GatewaySettings, add_gateway_arguments, settings_from_args
from trajbus.gateway.errors import bad_request
from trajbus.gateway.fleet import BACKLOG, GatewayFleet
from trajbus.gateway.prompts.tokenizer import check_tokenizer_path
from trajbus.gateway.service import GatewayService
from trajbus.infra import ray_exit
from trajbus.infra.allocator import run_on
from trajbus.infra.collector import tune_for_serving
from trajbus.infra.kafka_config import KafkaConfigError, apply_connection_arguments
from trajbus.infra.logs import configure_logging

log = logging.getLogger("trajbus.gateway")

MALFORMED = "malformed HTTP request (request line, headers or chunked body): it was not processed"


class JsonErrorProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering a request it cannot parse with an OpenAI-shaped JSON 400.

    uvicorn answers a request its parser refuses (a bad request line or header, an invalid chunked body,
    a non-ASCII path) from the protocol's ``send_400_response``, before any ASGI application sees it, so no
    middleware or exception handler can; the protocol class given as ``Config(http=...)`` is where it can
    be changed. What uvicorn does not let change: the reason (the parser's own message is dropped before
    ``send_400_response`` is called, hence one message for every case), its warning line, and the plain-text
    500 of its request cycle (``RequestResponseCycle``, built inside the protocol's parsing) for an
    application failing before it answers, which the gateway never does (every exception has a handler and
    a call cancelled at shutdown is ``middleware.Drain``'s). The h11 protocol would need the same override;
    the gateway runs httptools.
    """

    def send_400_response(self, msg: str) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()  # junk pipelined behind a call whose answer is under way: no 400 inside it
            return
        body = orjson.dumps(bad_request(MALFORMED, code="invalid_http_request").body())
        head = [STATUS_LINE[400], *(b"%s: %s\r\n" % header for header in self.server_state.default_headers),
                b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain on SIGTERM, for a load balancer (Kubernetes: ``infra/deploy/k8s``).

    uvicorn stops listening the moment it gets SIGTERM, before a load balancer has seen the instance go
    unready, and re-raises the signal after its shutdown (the process ends by the signal, not 0). Here
    SIGTERM begins the drain (``GatewayService.drain``): ``/ready`` answers 503 and new calls 503 with
    ``Retry-After`` at once, for ``--drain-delay`` seconds while it still listens; then uvicorn's shutdown
    stops listening and gives the calls in flight ``--drain-timeout`` seconds (``middleware.Drain`` answers
    the ones it cuts), the lifespan's end flushes the producer, and the process exits 0. A second SIGTERM
    ends the delay; SIGINT is uvicorn's (stop listening now).
    """

    def __init__(self, config: uvicorn.Config, service: GatewayService, drain_delay: float) -> None:
        super().__init__(config)
        self.service, self.drain_delay = service, drain_delay
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal handler: only flags (uvicorn's main loop acts on them in ``on_tick``)."""
        if sig != signal.SIGTERM:
            return super().handle_exit(sig, frame)
        if self.service.draining:
            self.should_exit = True  # a second SIGTERM: stop listening now
        self.service.drain()

    async def on_tick(self, counter: int) -> bool:
        since = self.service.draining_since
        if since is not None and not self.should_exit:
            if not self._announced:
                self._announced = True
                log.info("draining on SIGTERM: /ready and new calls answer 503; listening %.1fs more, then the "
                         "calls in flight have %.1fs", self.drain_delay, self.config.timeout_graceful_shutdown)
            if time.monotonic() - since >= self.drain_delay:
                log.info("drain delay over: no longer listening; calls in flight=%d", len(self.server_state.tasks))
                self.should_exit = True
        return await super().on_tick(counter)


SPARE_FILES = 1024
"""Open files beyond two per call in flight: Kafka's and the state's, the tokenizer's, the health checks'."""


def raise_open_files_limit(calls: int) -> None:
    """Each call in flight holds two sockets (its agent's, its engine's): the soft open-files limit is raised
    toward the hard one to hold them (often 1,024 by default, where the 1,000th agent's call would fail)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * calls + SPARE_FILES
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if raised < needed:
        log.warning("open files limited to %d (hard limit): about %d calls in flight fit, not the %d of "
                    "--max-concurrent-calls; raise the hard limit (ulimit -Hn, LimitNOFILE=)", raised,
                    (raised - SPARE_FILES) // 2, calls)


def refused(exc: Exception) -> int:
    """Settings that cannot work: one line on stderr, exit 2."""
    print(f"trajbus gateway: {exc}", file=sys.stderr)
    return EXIT_USAGE


def serve(settings: GatewaySettings, sockets: list[socket.socket] | None = None) -> int:
    """Validate what can be validated before listening (exit 2), then serve until SIGTERM/SIGINT, or until
    the gateway ends itself (``GatewayService.fatal``: Kafka away past its limit exits 1, a tokenizer that did
    not load 2); ``--instances N`` serves through a fleet of N processes (``gateway.fleet``), each of which
    ends here with the sockets the fleet bound."""
    from trajbus.gateway.app import create_app

    try:
        check_tokenizer_path(settings.tokenizer_path)
    except ValueError as exc:  # no such folder, no tokenizer in it: before anything starts
        return refused(exc)
    if sockets is None:  # a fleet's instance is forked on it already
        run_on(settings.allocator)  # the same command again on its allocator, unless it is on it (or cannot be)
    if settings.instances > 1:
        try:
            return GatewayFleet(settings, serve).run()
        except (ValueError, OSError) as exc:  # a public URL that cannot name instances, a port taken
            return refused(exc)

    try:
        app = create_app(settings)
    except ValueError as exc:  # e.g. an unimportable --reward-function
        return refused(exc)
    # log_config=None: uvicorn's lines go through our log setup (configure_logging), formatted as ours
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", log_config=None,
                            access_log=False, timeout_graceful_shutdown=settings.drain_timeout, loop="uvloop",
                            http=JsonErrorProtocol, backlog=BACKLOG)
    server = DrainingServer(config, app.state.service, settings.drain_delay)
    raise_open_files_limit(settings.max_concurrent_calls)
    tune_for_serving()  # the app is built: its objects are frozen, the collector set for the calls' lists
    gc_pauses.PAUSES.reset()  # /metrics counts the pauses calls can wait out, not the startup's
    app.state.service.stop_serving = lambda: setattr(server, "should_exit", True)  # graceful, as on SIGTERM
    server.run(sockets=sockets)
    service = app.state.service
    if service.fatal:
        print(f"trajbus gateway: {service.fatal}", file=sys.stderr)
    return ray_exit.exit_process(service.fatal_status if service.fatal else 0)  # Ray: end without its crash


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trajbus.gateway", description="The trajbus gateway.")
    add_gateway_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        apply_connection_arguments(args)
        settings = settings_from_args(args)
    except (KafkaConfigError, ValueError) as exc:
        return refused(exc)
    return serve(settings)
