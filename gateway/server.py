"""Running the gateway: ``python -m gateway`` and ``trajbus gateway`` end here."""

from __future__ import annotations

import argparse
import socket
import sys

from trajbus.gateway.config import GatewaySettings, add_gateway_arguments, settings_from_args
from trajbus.infra import ray_exit
from trajbus.infra.kafka_config import KafkaConfigError, apply_connection_arguments
from trajbus.infra.logs import configure_logging

EXIT_USAGE = 2


def serve(settings: GatewaySettings, sockets: list[socket.socket] | None = None) -> int:
    """Validate what can be validated before listening (exit 2), then serve until SIGTERM/SIGINT;
    ``--instances N`` serves through a fleet of N processes (``gateway.fleet``), each of which ends here
    with the sockets the fleet bound."""
    import uvicorn

    from trajbus.gateway.app import create_app

    if settings.instances > 1:
        from trajbus.gateway.fleet import GatewayFleet

        try:
            return GatewayFleet(settings).run()
        except (ValueError, OSError) as exc:  # a public URL that cannot name instances, a port taken
            print(f"trajbus gateway: {exc}", file=sys.stderr)
            return EXIT_USAGE

    try:
        app = create_app(settings)
    except ValueError as exc:  # e.g. an unimportable --reward-function
        print(f"trajbus gateway: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # log_config=None: uvicorn's lines go through our log setup (configure_logging), formatted as ours
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                           log_config=None, access_log=False, timeout_graceful_shutdown=10,
                                           loop="uvloop", http="httptools"))
    app.state.service.stop_serving = lambda: setattr(server, "should_exit", True)  # graceful, as on SIGTERM
    server.run(sockets=sockets)
    fatal = app.state.service.fatal
    if fatal:
        print(f"trajbus gateway: {fatal}", file=sys.stderr)
    return ray_exit.exit_process(1 if fatal else 0)  # a reward worker on Ray: end without Ray's crash at exit


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
        print(f"trajbus gateway: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return serve(settings)
