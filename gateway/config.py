"""The gateway's settings and the command-line flags that set them.

The flags of the seed design (``--vllm-addresses``, ``--tokenizer-path``,
``--prompt-length``, ...) are kept by name, so a launcher written for it starts
this gateway unchanged; ``--bootstrap-servers`` replaces the Ray data pool.
``python -m gateway`` and ``trajbus gateway`` share this one parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from trajbus.gateway.admission import SETTINGS as ADMISSION_SETTINGS
from trajbus.gateway.admission import AdmissionRules
from trajbus.gateway.conversation import CUMULATIVE, MULTI_TURN_MODES
from trajbus.infra.arguments import positive_float, positive_int
from trajbus.infra.kafka_config import add_connection_arguments
from trajbus.infra.paths import trajbus_cache_dir
from trajbus.streams.topics import DEFAULT_PREFIX, channel_setting, validate_channel

DEFAULT_PORT = 8100


@dataclass
class GatewaySettings:
    vllm_addresses: list[str]
    tokenizer_path: str
    prompt_length: int = 4096
    response_length: int = 1024
    bootstrap_servers: str | None = None
    prefix: str = DEFAULT_PREFIX
    default_channel: str = "train"
    reward_function: str | None = None
    reward_worker_name: str | None = None
    ray_address: str | None = None
    ray_namespace: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    public_url: str | None = None
    api_key: str | None = None
    state_dir: Path = field(default_factory=lambda: trajbus_cache_dir() / "gateway")
    max_body_bytes: int = 8 * 2**20
    health_interval: float = 2.0
    backend_timeout: float = 600.0
    publish_timeout: float = 30.0
    broker_outage_limit: float = 120.0
    """Seconds Kafka may be unreachable (calls answered 503 meanwhile) before the gateway exits non-zero."""
    """Seconds the broker has to acknowledge a call's steps (and to provision a new channel) before a 503."""
    served_model_name: str = "trajbus"
    multi_turn: str = CUMULATIVE
    admission: AdmissionRules = field(default_factory=AdmissionRules)
    """Pacing of new trajectories on every channel (off unless set: see ``--max-backlog-groups``)."""
    channel_admission: dict[str, AdmissionRules] = field(default_factory=dict)
    max_admission_wait: float = 120.0
    """The longest ``?wait=`` a new trajectory may ask to be held for."""
    idle_timeout: float = 1800.0
    """Seconds without a call after which a trajectory is abandoned (and no longer counts as in flight)."""
    finished_retention: float = 86400.0
    """Seconds a completed or abandoned trajectory is kept, so a late duplicate completion still gets 409."""

    @property
    def base_address(self) -> str:
        """What agents are told to call: ``--public-url``, else http://HOST:PORT."""
        if self.public_url:
            return self.public_url.rstrip("/")
        return f"http://{self.host}:{self.port}"


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


def _channel_admission(text: str) -> tuple[str, str, int | None]:
    channel, name, value = channel_setting(text)
    if name not in ADMISSION_SETTINGS:
        raise argparse.ArgumentTypeError(f"{name}: not an admission setting (known: {', '.join(ADMISSION_SETTINGS)})")
    return channel, name, None if value.lower() == "off" else positive_int(value)


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-addresses", type=_addresses, required=True,
                        help="comma-separated HOST:PORT of vLLM-compatible servers (round robin)")
    parser.add_argument("--tokenizer-path", required=True, help="Hugging Face tokenizer directory (local)")
    parser.add_argument("--prompt-length", type=positive_int, default=4096,
                        help="longest prompt in tokens; longer is 400 context_length_exceeded")
    parser.add_argument("--response-length", type=positive_int, default=1024,
                        help="most tokens one call may generate (the default max_tokens)")
    add_connection_arguments(parser)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="topic name prefix (default: %(default)s)")
    parser.add_argument("--channel", dest="default_channel", type=_channel, default="train",
                        help="channel of trajectories that name none (default: %(default)s)")
    parser.add_argument("--reward-function", help="dotted path of f(trajectory: dict) -> float")
    parser.add_argument("--reward-worker-name", help="named Ray actor with compute_reward(trajectory: dict)")
    parser.add_argument("--ray-address", help="Ray cluster of the reward worker (default: auto)")
    parser.add_argument("--ray-namespace", help="Ray namespace of the reward worker")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--public-url", help="base of the URLs handed to agents (default: http://HOST:PORT)")
    parser.add_argument("--api-key", help="bearer token required by white-box and admin endpoints")
    parser.add_argument("--state-dir", type=Path, default=trajbus_cache_dir() / "gateway",
                        help="where per-trajectory state survives restarts (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=positive_int, default=8 * 2**20)
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between backend health checks")
    parser.add_argument("--publish-timeout", type=positive_float, default=30.0,
                        help="seconds the broker has to acknowledge a call's steps before the call is "
                             "answered 503 (default: %(default)s)")
    parser.add_argument("--broker-outage-limit", type=positive_float, default=120.0,
                        help="seconds Kafka may be unreachable (calls are answered 503 meanwhile) before the "
                             "gateway exits non-zero for a supervisor (default: %(default)s)")
    parser.add_argument("--served-model-name", default="trajbus", help="model name in responses")
    parser.add_argument("--multi-turn", choices=MULTI_TURN_MODES, default=CUMULATIVE,
                        help="black-box prompts: 'cumulative' continues the sampled tokens of the conversation "
                             "(token-consistent turns), 'render' re-renders the whole conversation at every "
                             "call (default: %(default)s)")
    pacing = parser.add_argument_group(
        "admission (pacing new trajectories by the trainer; off unless set, because the right mark depends on "
        "the trainer's batch: at least its groups per step, or the trainer waits for groups never admitted)")
    pacing.add_argument("--max-backlog-groups", type=positive_int,
                        help="admit a new trajectory only while the trainer's backlog (ready groups it has not "
                             "committed + groups in flight at every gateway) is under N groups")
    pacing.add_argument("--max-staleness", type=positive_int,
                        help="admit a new trajectory only if the policy version it starts at is at most N "
                             "versions behind the trainer's")
    pacing.add_argument("--channel-admission", type=_channel_admission, action="append",
                        metavar="CHANNEL.SETTING=VALUE",
                        help="one channel's limit, e.g. val.max_backlog_groups=off (repeatable)")
    pacing.add_argument("--max-admission-wait", type=positive_float, default=120.0,
                        help="longest ?wait=SECONDS a new trajectory may ask to be held for (default: %(default)s)")
    state = parser.add_argument_group("trajectory state (bounded)")
    state.add_argument("--idle-timeout", type=positive_float, default=1800.0,
                       help="seconds without a call after which a trajectory is abandoned: it takes no more calls, "
                            "no longer counts as in flight, and the worker's group timeout decides its group "
                            "(default: %(default)s)")
    state.add_argument("--finished-retention", type=positive_float, default=86400.0,
                       help="seconds a completed or abandoned trajectory is kept (a late duplicate "
                            "complete_trajectory gets 409, not 404) (default: %(default)s)")


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    names = GatewaySettings.__dataclass_fields__
    settings = GatewaySettings(**{name: getattr(args, name) for name in names
                                  if hasattr(args, name) and name != "channel_admission"})
    settings.admission = AdmissionRules(args.max_backlog_groups, args.max_staleness)
    changes: dict[str, dict[str, int | None]] = {}
    for channel, name, value in args.channel_admission or []:
        changes.setdefault(channel, {})[name] = value
    settings.channel_admission = {channel: dataclasses.replace(settings.admission, **change)
                                  for channel, change in changes.items()}
    return settings
