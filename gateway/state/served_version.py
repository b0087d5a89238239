"""The policy version the engines serve: one owner for the gateway.

Two things tell it: the trainer's policy topic (``streams.wire.policy``: a channel's
``serving.`` key, else the trainer's version), followed once Kafka is connected,
and the last ``POST /admin/resume``, which names the version the engines were
loaded with (it may come before the gateway reads that version from Kafka). The
version served is the newer of the two. Steps are stamped with it, admission
measures a new trajectory's staleness from it, a resume to an older one is a
409, and a generation cut by a weight update continues under the resume's.
"""

from __future__ import annotations

from typing import Any, Protocol

from trajbus.gateway.errors import conflict
from trajbus.streams.client.policy import PolicyWatcher


class PublishedVersions(Protocol):
    """The policy topic as followed (``PolicyWatcher``)."""

    def serving(self, channel: str) -> int | None: ...

    def current(self, channel: str) -> int | None: ...

    def versions(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class ServedVersion:
    """The version served per channel, the trainer's, and the last resume's."""

    def __init__(self, prefix: str, default_channel: str, published: PublishedVersions | None = None) -> None:
        self.prefix, self.default_channel = prefix, default_channel
        self._published = published
        self.resumed: int | None = None
        """The version the last resume named (None: never resumed here)."""

    def watch(self, bootstrap_servers: str) -> None:
        """Follow the policy topic (Kafka connected)."""
        previous, self._published = self._published, PolicyWatcher(bootstrap_servers, prefix=self.prefix)
        if previous is not None:  # a connection tried again
            previous.close()

    def serving(self, channel: str | None = None) -> int | None:
        """The version the engines of ``channel`` (None: the default) serve; None when nothing says yet."""
        published = self._published.serving(channel or self.default_channel) if self._published is not None \
            else None
        resumed = self.resumed
        if published is None or (resumed is not None and resumed > published):
            return resumed
        return published

    def stamp(self, channel: str | None = None) -> int:
        """What a step sampled now is stamped with: the version served, 0 when none is known."""
        version = self.serving(channel)
        return 0 if version is None else version

    def trainer(self, channel: str) -> int | None:
        """The trainer's newest version of ``channel`` (admission's staleness bound)."""
        return self._published.current(channel) if self._published is not None else None

    def resume(self, version: int) -> None:
        """A resume names the version the engines now serve; 409 when it is older than the one served."""
        current = self.serving()
        if current is not None and version < current:
            raise conflict(f"version {version} is older than the version served, {current}")
        self.resumed = version

    def versions(self) -> dict[str, Any]:
        """Every key of the policy topic seen so far (``/statistics``)."""
        return self._published.versions() if self._published is not None else {}

    def close(self) -> None:
        if self._published is not None:
            self._published.close()
