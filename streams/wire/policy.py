"""The policy-version record on ``{prefix}.policy`` (compacted), and which key speaks for a channel.

Key: a channel name, or ``global`` for every channel: the version the trainer has reached. Key
``serving.<channel>`` or ``serving.global``: the version the inference engines serve, when their weights
lag the trainer's (published by whatever syncs them); without one, engines are taken to serve the
trainer's version. Value: UTF-8 JSON ``{"version": <int>, "published_at": <unix seconds>}``. Readers
take the newest value of the channel's key, else of ``global``.
"""

from __future__ import annotations

import json
import time
from typing import Mapping

GLOBAL = "global"
SERVING = "serving."
"""Key prefix of the version the inference engines serve."""
CONTENT_TYPE = "application/json; schema=trajbus.policy-version; v=1"


def policy_key(channel: str, serving: bool = False) -> str:
    """The key a version of ``channel`` (or ``GLOBAL``) is published under: the trainer's, or the engines'."""
    return f"{SERVING}{channel}" if serving else channel


def encode_policy_version(version: int) -> bytes:
    if type(version) is not int:
        raise ValueError(f"version: must be an integer, got {version!r}")
    return json.dumps({"version": version, "published_at": time.time()}).encode()


def decode_policy_version(value: bytes) -> int:
    try:
        version = json.loads(value)["version"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a policy version record: {exc}") from None
    if type(version) is not int:
        raise ValueError(f"policy version is not an integer: {version!r}")
    return version


def trainer_version(versions: Mapping[str, int], channel: str) -> int | None:
    """The trainer's version for ``channel`` among the newest value of each key: its key's, else ``global``'s."""
    version = versions.get(channel)
    return versions.get(GLOBAL) if version is None else version


def serving_version(versions: Mapping[str, int], channel: str) -> int | None:
    """The version the engines of ``channel`` serve: its ``serving.`` key, else ``serving.global``, else the
    trainer's version."""
    version = versions.get(SERVING + channel, versions.get(SERVING + GLOBAL))
    return trainer_version(versions, channel) if version is None else version
