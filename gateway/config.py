"""The gateway's settings, declared once: their flags and environment variables derive from them.

The flags of the seed design (``--vllm-addresses``, ``--tokenizer-path``,
``--prompt-length``, ...) are kept by name, so a launcher written for it starts
this gateway unchanged; ``--bootstrap-servers`` replaces the Ray data pool.
``python -m trajbus.gateway`` and ``trajbus gateway`` share this one parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from trajbus.gateway.admission.rules import AdmissionRules
from trajbus.gateway.admission.rules import SETTINGS as ADMISSION_SETTINGS
from trajbus.gateway.broker.channels import REFRESH_SECONDS
from trajbus.gateway.engine.pool import ENGINE_CONNECTIONS
from trajbus.gateway.prompts.conversation import CUMULATIVE, MULTI_TURN_MODES
from trajbus.gateway.state.trajectories import CACHED_TRAJECTORIES
from trajbus.infra.allocator import ALLOCATORS, SYSTEM
from trajbus.infra.arguments import non_negative_float, positive_float, positive_int, seconds
from trajbus.infra.collector import FULL_SECONDS
from trajbus.infra.declared import add_flags, missing_flags, resolve, setting
from trajbus.infra.kafka_config import add_connection_arguments
from trajbus.infra.paths import trajbus_cache_dir
from trajbus.infra.shared_settings import outage_limit_setting, prefix_setting, tracing_setting
from trajbus.streams.wire.topics import DEFAULT_PREFIX, channel_setting, validate_channel

DEFAULT_PORT = 8100
EXIT_USAGE = 2
"""The exit status of a gateway whose settings cannot work (a bad flag, a tokenizer that does not load), as every
``trajbus`` command's bad input."""
ENGINE_STREAMING = ("always", "when-asked")


ENV_PREFIX = "TRAJBUS_GATEWAY_"
"""The gateway's settings as environment variables (``TRAJBUS_GATEWAY_PROMPT_LENGTH``)."""


def _addresses(text: str) -> list[str]:
    addresses = []
    for item in text.split(","):
        item = item.strip().rstrip("/")
        if not item:
            continue
        if not item.startswith(("http://", "https://")):
            item = f"http://{item}"
        addresses.append(item)
    if not addresses:
        raise argparse.ArgumentTypeError("expected at least one HOST:PORT")
    return addresses


def _channel(text: str) -> str:
    try:
        return validate_channel(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _channel_list(text: str) -> tuple[str, ...]:
    """``--channels``: comma-separated channel names, at least one."""
    channels = tuple(dict.fromkeys(_channel(c.strip()) for c in text.split(",") if c.strip()))
    if not channels:
        raise argparse.ArgumentTypeError("expected at least one channel name")
    return channels


def _channel_admission(text: str) -> tuple[str, str, int | None]:
    channel, name, value = channel_setting(text)
    if name not in ADMISSION_SETTINGS:
        raise argparse.ArgumentTypeError(f"{name}: not an admission setting (known: {', '.join(ADMISSION_SETTINGS)})")
    return channel, name, None if value.lower() == "off" else positive_int(value)


def _instances(text: str) -> int:
    """``--instances``: a positive count, or ``auto``: one per core this process may run on."""
    return len(os.sched_getaffinity(0)) if text.strip().lower() == "auto" else positive_int(text)


@dataclass
class GatewaySettings:
    """Every gateway setting: a flag each (``add_gateway_arguments``) and a ``TRAJBUS_GATEWAY_*`` variable."""

    vllm_addresses: list[str] = setting(
        parse=_addresses, help="comma-separated HOST:PORT of vLLM-compatible servers (round robin)")
    tokenizer_path: str = setting(help="Hugging Face tokenizer directory (local)")
    prompt_length: int = setting(4096, parse=positive_int,
                                 help="longest prompt in tokens; longer is 400 context_length_exceeded")
    response_length: int = setting(1024, parse=positive_int,
                                   help="most tokens one call may generate (the default max_tokens)")
    bootstrap_servers: str | None = None
    """From the connection flags (``--bootstrap-servers``), shared by every command."""
    prefix: str = prefix_setting(DEFAULT_PREFIX)
    default_channel: str = setting("train", flag="--channel", parse=_channel,
                                   help="channel of trajectories that name none")
    channels: tuple[str, ...] | None = setting(
        None, parse=_channel_list,
        help="comma-separated channels calls may name, provisioned at start with the default channel; off: the "
             "channels whose steps topic exists under --prefix (made by `trajbus topics --create --channels` or a "
             f"worker), read again when a call names another (at most every {REFRESH_SECONDS:g} s); a call naming "
             "a channel that is neither is answered 400 unknown_channel")
    reward_function: str | None = setting(None, help="dotted path of f(trajectory: dict) -> float")
    reward_worker_name: str | None = setting(None, help="named Ray actor with compute_reward(trajectory: dict)")
    ray_address: str | None = setting(None, help="Ray cluster of the reward worker (off: auto)")
    ray_namespace: str | None = setting(None, help="Ray namespace of the reward worker")
    host: str = setting("127.0.0.1", help="interface to listen on")
    port: int = setting(DEFAULT_PORT, help="port to listen on")
    public_url: str | None = setting(
        None, help="base of the URLs handed to agents, which must reach this instance (off: http://HOST:PORT; "
                   "{instance} and {port} are replaced, for --instances)")
    instance_id: str | None = setting(
        None, help="this gateway's name in a fleet: its in-flight groups on Kafka, /statistics and metrics "
                   "(off: HOSTNAME-PORT; keep it across restarts)")
    instances: int = setting(
        1, parse=_instances,
        help="start N gateway processes on this host as one door: any of them answers on --port; instance i "
             "also listens on --port + 1 + i, which its base_urls name, with its own state under "
             "--state-dir/instance-i; a process that dies is restarted; auto: one per core")
    allocator: str = setting(
        SYSTEM, choices=ALLOCATORS,
        help="the C allocator the gateway runs on: 'system', the C library's malloc; 'mimalloc' (the "
             "cmeel-mimalloc wheel's, preloaded: the gateway starts itself again with it) costs 12-20% less CPU a "
             "call at 256-4,096 agents and holds about 1.4x the memory per context token once they are quiet "
             "(docs/gateway.md)")
    max_concurrent_calls: int = setting(
        4096, parse=positive_int,
        help="engine calls (chat/completions, messages, /generate) one instance serves at once; beyond, a call "
             "is answered 503 with Retry-After at once rather than queued until its client times out. An agent "
             "waits on one call at a time: size it to the agents one instance serves")
    engine_connections: int = setting(
        ENGINE_CONNECTIONS, parse=positive_int,
        help="connections one instance opens to each engine at most; calls beyond wait for one. Thousands opened "
             "at once overflow an engine's listening queue (vLLM's: 2,048) and fail as if it were down: keep it "
             "below that queue divided by the instances in front of the engine")
    cached_trajectories: int = setting(
        CACHED_TRAJECTORIES, parse=positive_int,
        help="open trajectories whose state a call reads from memory (the most recently used; another one's is "
             "read from --state-dir and replayed, which costs its turns). Size it to the agents one instance "
             "serves: each holds its context at 4 bytes a token here, and as much again as the steps' prefix "
             "base, up to --prompt-length + --response-length tokens")
    full_collection_every: float = setting(
        FULL_SECONDS, parse=positive_float,
        help="at most this many seconds between two of Python's full collections, which free the rare cycles the "
             "calls leave (run when no call is in flight once due, else on the event loop); it walks every object "
             "of the process and, with calls in flight, stops them all meanwhile")
    drain_delay: float = setting(
        5.0, parse=seconds,
        help="on SIGTERM, seconds the gateway keeps listening while /ready answers 503 and new calls get 503 with "
             "Retry-After (calls in flight go on), so load balancers see it unready and stop sending before "
             "connections are refused; 0: stop listening at once")
    drain_timeout: float = setting(
        20.0, parse=seconds,
        help="after the drain delay, seconds the calls still in flight have to end; a call not answered by then gets "
             "503 with Retry-After (a stream already under way is cut), then the producer is flushed and the process "
             "exits 0")
    api_key: str | None = setting(None, help="bearer token required by white-box and admin endpoints")
    state_dir: Path = setting(default_factory=lambda: trajbus_cache_dir() / "gateway",
                              help="where per-trajectory state survives restarts")
    max_body_bytes: int = setting(8 * 2**20, parse=positive_int, help="largest request body")
    health_interval: float = setting(2.0, parse=positive_float, help="seconds between backend health checks")
    backend_timeout: float = setting(600.0, parse=positive_float,
                                     help="seconds an inference backend has to answer one call")
    publish_timeout: float = setting(
        30.0, parse=positive_float,
        help="seconds the broker has to acknowledge a call's steps (and to check a channel's topics at its first "
             "call) before a 503")
    broker_outage_limit: float = outage_limit_setting("gateway", "calls are answered 503 meanwhile")
    tracing: str = tracing_setting("gateway")
    engine_streaming: str = setting(
        "always", choices=ENGINE_STREAMING,
        help="'always': every call streams from the engine, so a weight update (POST /admin/pause) can cut it and "
             "continue it under the new weights; 'when-asked': a client that does not stream gets the engine's one "
             "JSON answer, which a pause cannot cut and waits for")
    engine_stream_interval: int = setting(
        16, parse=positive_int,
        help="tokens per event the gateway asks of an engine stream that no client reads as it comes (the agent "
             "asked for one JSON answer), by the request field stream_interval (vLLM's sampling parameter; a "
             "server that does not take it ignores it: start the engine with its own --stream-interval then); a "
             "weight update still cuts such a stream, and the tokens the engine had not sent are sampled again. "
             "An event costs the gateway and the engine far more than a token; 1 asks for one event a token")
    engine_read_interval: float = setting(
        0.0, parse=non_negative_float,
        help="seconds the gateway waits after reading an engine stream before it reads again, so a fast engine's "
             "tokens are read many at a time (less gateway CPU a token) at the price of up to this much latency at "
             "a call's end; 0 reads as soon as bytes arrive")
    max_pause: float = setting(
        300.0, parse=positive_float,
        help="seconds generation may stay paused for a weight update (POST /admin/pause) before the calls it "
             "holds or cut end with 503 and Retry-After instead of waiting for the resume")
    served_model_name: str = setting("trajbus", help="model name in responses")
    multi_turn: str = setting(
        CUMULATIVE, choices=MULTI_TURN_MODES,
        help="black-box prompts: 'cumulative' continues the sampled tokens of the conversation (token-consistent "
             "turns), 'render' re-renders the whole conversation at every call")
    max_backlog_groups: int | None = setting(
        None, parse=positive_int,
        help="admission: admit a new trajectory only while the trainer's backlog (ready groups it has not "
             "committed + groups in flight at every gateway) is under N groups; off unless set, because the right "
             "mark depends on the trainer's batch: at least its groups per step, or the trainer waits for groups "
             "never admitted")
    max_staleness: int | None = setting(
        None, parse=positive_int,
        help="admission: admit a new trajectory only if the policy version it starts at is at most N versions "
             "behind the trainer's")
    channel_admission: list[tuple[str, str, int | None]] = setting(
        default_factory=list, parse=_channel_admission, repeat=True,
        help="admission: one channel's limit as CHANNEL.SETTING=VALUE, e.g. val.max_backlog_groups=off "
             "(repeatable)")
    max_admission_wait: float = setting(120.0, parse=positive_float,
                                        help="the longest ?wait=SECONDS a new trajectory may ask to be held for")
    idle_timeout: float = setting(
        1800.0, parse=positive_float,
        help="seconds without a call after which a trajectory is abandoned: it takes no more calls, no longer "
             "counts as in flight, and the worker's group timeout decides its group")
    finished_retention: float = setting(
        86400.0, parse=positive_float,
        help="seconds a completed or abandoned trajectory is kept (a late duplicate complete_trajectory gets "
             "409, not 404)")

    @property
    def admission(self) -> AdmissionRules:
        """Pacing of new trajectories on every channel (off unless set: see ``--max-backlog-groups``)."""
        return AdmissionRules(self.max_backlog_groups, self.max_staleness)

    @property
    def admission_by_channel(self) -> dict[str, AdmissionRules]:
        """The channels whose pacing differs from ``admission``, with their rules."""
        changes: dict[str, dict[str, int | None]] = {}
        for channel, name, value in self.channel_admission:
            changes.setdefault(channel, {})[name] = value
        return {channel: dataclasses.replace(self.admission, **change) for channel, change in changes.items()}

    @property
    def instance(self) -> str:
        """This instance's name: ``--instance-id``, else HOSTNAME-PORT (stable across restarts)."""
        return self.instance_id or f"{socket.gethostname()}-{self.port}"

    @property
    def base_address(self) -> str:
        """What agents are told to call: ``--public-url``, else http://HOST:PORT."""
        if self.public_url:
            url = self.public_url.replace("{instance}", self.instance).replace("{port}", str(self.port))
            return url.rstrip("/")
        return f"http://{self.host}:{self.port}"


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags: one per ``GatewaySettings`` field, plus the Kafka connection."""
    add_connection_arguments(parser)
    add_flags(parser, GatewaySettings, ENV_PREFIX)


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """Flags, else ``TRAJBUS_GATEWAY_*``, else the defaults (``ValueError`` naming a bad variable)."""
    values = resolve(GatewaySettings, args, ENV_PREFIX)
    missing = missing_flags(GatewaySettings, values)
    if missing:
        raise ValueError(f"{', '.join(missing)} required (or ${ENV_PREFIX}<NAME>)")
    return GatewaySettings(bootstrap_servers=args.bootstrap_servers, **values)
