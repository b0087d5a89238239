"""The channels the gateway takes: those whose topics exist, so a misspelled channel is a 400, not a topic nobody reads.

A call naming a channel that has no steps topic (``{prefix}.steps.{channel}``) under the gateway's prefix
is refused with a 400 naming the channels there are: no worker would read its steps, and its groups would
never reach a trainer. The gateway never creates a channel on a call; creating one is an explicit act
(``trajbus topics --create --channels NAME``, or starting a worker for it). Only the default channel
(``--channel``) is provisioned by the gateway, at start, so it works out of the box; ``--channels``
declares the list instead of reading it from the broker (those channels are provisioned at start too).

The hot path reads a set in memory. A call naming a channel not in it waits for a read of the broker's
topics begun after it arrived, reads being at least ``REFRESH_SECONDS`` apart: a channel whose topics
exist when a call names it is taken (created after the gateway started too), a wrong one is refused within
``REFRESH_SECONDS``, and a flood of calls naming wrong channels costs the broker one metadata request per
interval, shared by every call waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable, Iterable

from trajbus.gateway.errors import GatewayError, bad_request, unavailable
from trajbus.streams.wire.topics import channels_in, unknown_channel_fix, validate_channel

REFRESH_SECONDS = 2.0
"""The least time between two reads of the broker's topics, however many calls name unknown channels."""


def unknown_channel(channel: str, known: list[str], declared: bool, prefix: str) -> GatewayError:
    """400 naming the channels this gateway takes, and how a new channel is created."""
    if declared:
        why = f"not one of this gateway's --channels (known channels: {', '.join(known)})"
    else:
        why = (f"there is no topic {prefix}.steps.{channel}, so no worker would read its steps (known channels: "
               f"{', '.join(known)}); {unknown_channel_fix(channel, prefix)}")
    return bad_request(f"channel: {channel!r} is unknown: {why}", param="channel", code="unknown_channel")


class KnownChannels:
    """The channels calls may name: read from the broker's steps topics (or declared), refreshed on a miss."""

    def __init__(self, prefix: str, default: str, declared: Iterable[str] | None = None,
                 refresh_seconds: float = REFRESH_SECONDS) -> None:
        self.prefix, self.default, self.refresh_seconds = prefix, default, refresh_seconds
        self.declared = None if declared is None else frozenset(declared) | {default}
        self._known: frozenset[str] = self.declared or frozenset({default})
        self._topic_names: Callable[[], Iterable[str]] | None = None
        self._read_at = float("-inf")
        self._read_error: str | None = None
        self._reading = asyncio.Lock()

    @property
    def provisioned_at_start(self) -> list[str]:
        """The channels the gateway provisions when it connects: the default one, and those declared."""
        return sorted(self.declared or {self.default})

    def known(self) -> list[str]:
        return sorted(self._known)

    def connect(self, topic_names: Callable[[], Iterable[str]]) -> None:
        """Once Kafka is connected (on the link's thread): read the channels now, and on a miss later."""
        self._topic_names = topic_names
        if self.declared is None:
            self._read()

    def _read(self) -> None:
        """The channels of the steps topics under the prefix (blocking: a metadata request)."""
        self._read_at = time.monotonic()
        try:
            names = self._topic_names()
        except Exception as exc:  # the broker did not answer: the next miss after the interval asks again
            self._read_error = f"{type(exc).__name__}: {exc}"
            raise
        self._read_error = None
        self._known = frozenset(channels_in(names, self.prefix)) | {self.default}

    async def check(self, channel: str | None) -> str:
        """The channel (the default when None) if calls may name it; else 400 (unknown, or not a valid
        name), or 503 while the broker cannot say."""
        channel = channel or self.default
        if channel in self._known:  # every call but a miss: no broker, no await
            return channel
        try:
            validate_channel(channel)
        except ValueError as exc:
            raise bad_request(str(exc), param="channel") from None
        if self.declared is None:
            await self._refresh_for(channel)
            if channel in self._known:
                return channel
        raise unknown_channel(channel, self.known(), self.declared is not None, self.prefix)

    async def _refresh_for(self, channel: str) -> None:
        """Make sure a read of the broker's topics began after this call arrived: the one under way, or the
        next one, at most one per interval (so a miss waits ``refresh_seconds`` at most)."""
        if self._topic_names is None:
            raise unavailable(f"channel: cannot tell yet whether {channel!r} exists: Kafka is not connected",
                              code="kafka_unavailable")
        arrived = time.monotonic()
        async with self._reading:  # misses waiting here share the read that follows their arrival
            if self._read_at < arrived and channel not in self._known:
                await asyncio.sleep(self._read_at + self.refresh_seconds - time.monotonic())
                with contextlib.suppress(Exception):  # a failed read is answered below, from the error it kept
                    await asyncio.to_thread(self._read)
            if self._read_error is not None and channel not in self._known:
                raise unavailable(f"channel: cannot tell whether {channel!r} exists: the broker did not list its "
                                  f"topics ({self._read_error})", code="kafka_unavailable")
