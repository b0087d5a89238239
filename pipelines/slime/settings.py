"""The settings of trajbus inside slime, declared once: keys of slime's ``--custom-config-path`` YAML.

slime copies every key of that YAML onto its ``args`` (``slime.utils.arguments``, after parsing), so
``trajbus_bootstrap_servers: host:9092`` arrives as ``args.trajbus_bootstrap_servers``. Each setting
is that key, else the variable ``TRAJBUS_SLIME_<NAME>``, else its default; the broker is found as every
trajbus component finds it (the key, else ``TRAJBUS_BOOTSTRAP_SERVERS``, else the embedded broker of
``trajbus broker up``). A ``trajbus_`` key that names no setting is refused, naming the known ones: a
typo would otherwise leave the data source without its ledger.

``source_args`` reads slime's data-source arguments off the same ``args``, with slime's defaults for
those a bare ``args`` lacks (slime's own contract tests build data sources that way).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from trajbus.infra.arguments import positive_float, positive_int
from trajbus.infra.bootstrap import BrokerNotFound, resolve_bootstrap_servers
from trajbus.infra.declared import declared_fields, parse_text, resolve, setting
from trajbus.infra.shared_settings import prefix_setting
from trajbus.pipelines.data_source import DataSourceArgs
from trajbus.pipelines.ledger import PromptLedger
from trajbus.streams.wire.topics import DEFAULT_PREFIX, validate_channel, validate_prefix

log = logging.getLogger("trajbus.slime")

ARG_PREFIX = "trajbus_"
ENV_PREFIX = "TRAJBUS_SLIME_"
SETTLED_BY = ("rollout", "worker")
SGLANG_ROLLOUT = "slime.rollout.sglang_rollout.generate_rollout"
CALCULATOR_AGENT = "trajbus.pipelines.slime.agents.calculator_agent"


@dataclass(frozen=True)
class SlimeSettings:
    """Where the data source keeps its prompt ledger, who settles each group on it, and (the agentic rollout,
    ``pipelines.slime.agentic``) which gateway and agent run its samples."""

    bootstrap_servers: str | None = setting(None, help=(
        "Kafka bootstrap servers (else $TRAJBUS_BOOTSTRAP_SERVERS, else the embedded broker of `trajbus broker "
        "up`); with none, the data source runs without a prompt ledger, as slime's own"))
    prefix: str = prefix_setting(DEFAULT_PREFIX)
    channel: str = setting("train", help="the channel whose prompt ledger ({prefix}.prompts.{channel}) is kept")
    settled_by: str = setting("rollout", choices=SETTLED_BY, help=(
        "who records how each group handed out ended: rollout (slime's own rollout function, run by "
        "trajbus.pipelines.slime.sglang.generate_rollout) or worker (rollouts through trajbus's gateway, "
        "whose stream worker records each group)"))
    rollout_function_path: str = setting(SGLANG_ROLLOUT, help=(
        "the rollout function trajbus.pipelines.slime.sglang.generate_rollout runs and then settles"))
    ledger_timeout: float = setting(30.0, parse=positive_float, help=(
        "seconds a prompt-ledger read or acknowledged write may take"))
    gateway_url: str = setting("http://127.0.0.1:8100", help=(
        "the trajbus gateway whose base_urls the agents of trajbus.pipelines.slime.agentic.generate_rollout get"))
    gateway_api_key: str | None = setting(None, help="the gateway's --api-key, when it has one")
    agent_path: str = setting(CALCULATOR_AGENT, help=(
        "the agent the agentic rollout runs per sample: agent(base_url, sample, sampling) -> reward or None"))
    agent_concurrency: int = setting(64, parse=positive_int, help="agents the agentic rollout runs at once")
    eval_channel: str = setting("val", help="the channel the agentic rollout's evaluation goes through")
    group_timeout: float = setting(600.0, parse=positive_float, help=(
        "seconds the agentic rollout waits for its next group, groups in flight, before it gives up"))

    def __post_init__(self) -> None:
        validate_prefix(self.prefix)
        validate_channel(self.channel)
        validate_channel(self.eval_channel)

    @classmethod
    def from_args(cls, args: Any, environ: Mapping[str, str] | None = None) -> "SlimeSettings":
        """The settings slime's ``args`` carries (``trajbus_<name>``), then the environment's; ``ValueError``
        naming the key or the variable that is wrong."""
        known = {f.name: (f, hint) for f, _, hint in declared_fields(cls)}
        given = vars(args) if hasattr(args, "__dict__") else {}
        unknown = sorted(k for k in given if k.startswith(ARG_PREFIX) and k[len(ARG_PREFIX):] not in known)
        if unknown:
            raise ValueError(f"{unknown[0]}: not a trajbus setting of the --custom-config-path YAML (known: "
                             f"{', '.join(ARG_PREFIX + name for name in known)})")
        values = resolve(cls, argparse.Namespace(), ENV_PREFIX, environ)
        for name, (f, hint) in known.items():
            value = getattr(args, ARG_PREFIX + name, None)
            if value is None:
                continue
            try:
                values[name] = parse_text(f, hint, str(value))
            except ValueError as exc:
                raise ValueError(f"{ARG_PREFIX}{name}: {exc}") from None
        return cls(**values)

    def open_ledger(self, policy_version: Callable[[], int | None]) -> PromptLedger | None:
        """The channel's prompt ledger, or None (one line saying what to give) when no broker is found."""
        try:
            servers = resolve_bootstrap_servers(self.bootstrap_servers)
        except BrokerNotFound:
            log.warning("trajbus data source: no Kafka broker, so no prompt ledger (slime's semantics only: "
                        "nothing survives a crash beyond the saved cursor and buffer); give one as "
                        "trajbus_bootstrap_servers in the --custom-config-path YAML or as $TRAJBUS_BOOTSTRAP_SERVERS")
            return None
        return PromptLedger(servers, self.channel, self.prefix, policy_version, self.ledger_timeout)


def source_args(args: Any) -> DataSourceArgs:
    """slime's data-source arguments off its ``args`` (slime's defaults where a bare ``args`` has none).
    The tokenizer is slime's ``hf_checkpoint``; a dataset needs ``prompt_data`` as in slime."""
    defaults = DataSourceArgs()
    values = {f.name: getattr(args, f.name, getattr(defaults, f.name)) for f in dataclasses.fields(DataSourceArgs)}
    values["tokenizer_path"] = getattr(args, "tokenizer_path", None) or getattr(args, "hf_checkpoint", None)
    values["rollout_global_dataset"] = bool(values["rollout_global_dataset"] and values["prompt_data"])
    if values["rollout_global_dataset"] and getattr(args, "multimodal_keys", None):
        raise ValueError("multimodal_keys: trajbus's data source reads text prompts only; keep slime's "
                         "--data-source-path for a multimodal dataset")
    for name in ("input_key", "metadata_key", "n_samples_per_prompt", "rollout_seed"):
        if values[name] is None:
            values[name] = getattr(defaults, name)
    return DataSourceArgs(**values)
