"""A trainer's commits that ride through the cluster losing a node: no client exception reaches its loop.

A commit goes to the consumer group's coordinator. When the node that holds it dies, two things happen:
the coordinator moves (a commit meanwhile fails with a coordinator error, or times out) and, if the move
outlasts the session, the group forgets the consumer (``UNKNOWN_MEMBER_ID``, ``ILLEGAL_GENERATION``, a
rebalance in progress). The first is waited out, with the one retry policy (``infra.retry``), up to the
consumer's outage limit. The second no retry mends until the consumer has joined again, which its next
poll does: the commit is kept pending and made once a later fetch finds the consumer assigned again.

Nothing is handed out twice meanwhile: a ``BatchConsumer`` reads on from its own position after a
rejoin, never from the group's last commit. A group handed out and not yet committed when the
membership was lost is committed by that pending commit; if the trainer dies before it is made, the
trainer's own checkpoint (``TrainingState``) says where to resume, as after any crash.
"""

from __future__ import annotations

import logging

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from trajbus.infra.retry import retrying

log = logging.getLogger("trajbus.consumers")

MEMBERSHIP_LOST = frozenset({KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION,
                             KafkaError.REBALANCE_IN_PROGRESS, KafkaError._ASSIGNMENT_LOST})
"""Commit errors that say the group no longer counts this consumer a member (until it joins again)."""


class MembershipLost(Exception):
    """The consumer group forgot this consumer: its commit waits until it has joined again."""


class GroupCommits:
    """Synchronous commits of one consumer, retried through a coordinator's move (module docstring)."""

    def __init__(self, consumer: Consumer, group_id: str, outage_limit: float) -> None:
        self.consumer, self.group_id, self.outage_limit = consumer, group_id, outage_limit
        self.pending: list[TopicPartition] | None = None
        """Offsets whose commit waits for the consumer to join its group again."""

    def commit(self, offsets: list[TopicPartition]) -> None:
        """Commit ``offsets``, or keep them pending when the group lost this consumer."""
        try:
            for attempt in retrying(self.outage_limit, log, f"commit of {self.group_id}",
                                    permanent=(MembershipLost,), transient=(KafkaException,)):
                with attempt:
                    self._commit(offsets)
            self.pending = None
        except MembershipLost as lost:
            self.pending = offsets
            log.info("commit of %s waits for the consumer to rejoin its group (%s)", self.group_id, lost)

    def retry_pending(self) -> None:
        """After a poll: make a pending commit once the consumer is assigned partitions again, for the
        partitions it holds (one another member took reads it from the group's last commit: at least once
        between members)."""
        if self.pending is None:
            return
        held = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        if not held:
            return
        mine = [tp for tp in self.pending if (tp.topic, tp.partition) in held]
        try:
            if mine:
                self._commit(mine)
        except (MembershipLost, KafkaException) as exc:
            log.debug("pending commit of %s not made yet: %s", self.group_id, exc)
            return
        log.info("pending commit of %s made after the consumer rejoined (%d of %d partitions still its own)",
                 self.group_id, len(mine), len(self.pending))
        self.pending = None

    def _commit(self, offsets: list[TopicPartition]) -> None:
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if error is not None and error.code() in MEMBERSHIP_LOST:
                raise MembershipLost(error.str()) from None
            raise
