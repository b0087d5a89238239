"""Topic names and channel names: where each record of the wire contract lives.

``{prefix}.steps.{channel}``  step events, key = prompt_uid
``{prefix}.groups.{channel}`` ready prompt groups; retention is the backpressure
``{prefix}.chunks.{channel}`` the bytes of groups too large for one record (``streams.wire.chunks``)
``{prefix}.prompts.{channel}`` the prompt ledger: groups handed out and how each ended (compacted, ``streams.wire.ledger``)
``{prefix}.trained.{channel}`` the trained log: the groups of each trainer step (kept forever, ``streams.wire.trained``)
``{prefix}.policy``           the trainer's policy version (compacted)
``{prefix}.dlq``              records that could not be processed, with the reason
``{prefix}.stats``            statistics snapshots of the stream workers (compacted)
``{prefix}.traces``           spans of the components that trace (``--tracing kafka``, read by ``trajbus trace``)

Their partition counts and configs are ``streams.client.topic_settings.TopicSettings``.
"""

from __future__ import annotations

import argparse
import re
from typing import Iterable

DEFAULT_PREFIX = "trajbus"
DEFAULT_CHANNELS = ("train", "val")

_CHANNEL = re.compile(r"[a-z0-9_-]{1,64}")
_PREFIX = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


def validate_channel(channel: object) -> str:
    """Channel names become topic names, so they are restricted to ``[a-z0-9_-]{1,64}``."""
    if not isinstance(channel, str) or not _CHANNEL.fullmatch(channel):
        raise ValueError(f"channel: {channel!r} is not a valid channel name (expected [a-z0-9_-]{{1,64}})")
    return channel


def channel_setting(text: str) -> tuple[str, str, str]:
    """``CHANNEL.SETTING=VALUE`` (a per-channel flag) -> (channel, setting, value); argparse ``type=``."""
    target, sep, value = text.partition("=")
    channel, dot, name = target.partition(".")
    if not sep or not dot:
        raise argparse.ArgumentTypeError(f"expected CHANNEL.SETTING=VALUE, got {text!r}")
    try:
        validate_channel(channel)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return channel, name, value


def validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(f"prefix: {prefix!r} is not a valid topic prefix")
    return prefix


def steps_topic(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}.steps.{validate_channel(channel)}"


def groups_topic(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}.groups.{validate_channel(channel)}"


def chunks_topic(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Chunks of group records too large for one record; the groups topic names them."""
    return f"{prefix}.chunks.{validate_channel(channel)}"


def prompts_topic(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The prompt ledger of a channel (``streams.wire.ledger``): one partition, compacted."""
    return f"{prefix}.prompts.{validate_channel(channel)}"


def trained_topic(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The trained log of a channel (created by the first trainer that records a step)."""
    return f"{prefix}.trained.{validate_channel(channel)}"


def policy_topic(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}.policy"


def dlq_topic(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}.dlq"


def stats_topic(prefix: str = DEFAULT_PREFIX) -> str:
    """Statistics snapshots of the stream workers (compacted, keyed by worker id)."""
    return f"{prefix}.stats"


def traces_topic(prefix: str = DEFAULT_PREFIX) -> str:
    """Finished spans of every component that traces to Kafka (``infra.tracing``), keyed by trajectory."""
    return f"{prefix}.traces"


def trainer_group_id(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The consumer group trainers read a channel's groups in; its lag is the queue depth."""
    return f"{prefix}.trainer.{validate_channel(channel)}"


def channels_in(topic_names: Iterable[str], prefix: str = DEFAULT_PREFIX, kind: str = "steps") -> list[str]:
    """The channels among ``topic_names`` that have a ``kind`` topic under ``prefix`` (``steps``: what a worker
    reads; ``groups``: what a trainer reads), sorted: what a refusal of an unknown channel names. Names that
    are no channel's (another prefix's, ``{prefix}.steps.Bad``) are passed over."""
    head = f"{prefix}.{kind}."
    return sorted({name[len(head):] for name in topic_names
                   if name.startswith(head) and _CHANNEL.fullmatch(name[len(head):])})


def unknown_channel_fix(channel: str, prefix: str = DEFAULT_PREFIX) -> str:
    """What a refusal of a channel without topics tells to do: the command that creates them (``--prefix``
    named unless it is the default)."""
    command = f"trajbus topics --create --channels {channel}"
    command = command if prefix == DEFAULT_PREFIX else f"{command} --prefix {prefix}"
    return f"fix the name, or create the channel with `{command}` and run a worker for it"


def channel_of(topic: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The channel a steps or groups topic belongs to (``ValueError`` for other topics)."""
    for kind in ("steps", "groups"):
        head = f"{prefix}.{kind}."
        if topic.startswith(head):
            return validate_channel(topic[len(head):])
    raise ValueError(f"topic {topic!r} is not a trajbus steps or groups topic under prefix {prefix!r}")
