"""A trainers' group that holds none of its channel's partitions is made to share them out again
(``consumers.assignment``): asked only once the consumer held nothing for the timeout, and only when the topic
has partitions that no member of the group holds."""

from __future__ import annotations

from trajbus.consumers.assignment import AssignmentCheck


class Cluster:
    """What the check asks, as the test sets it, and what it did."""

    def __init__(self) -> None:
        self.now, self.holds, self.partitions, self.group_holds = 0.0, False, 1, False
        self.asked = self.rejoined = 0

    def check(self, timeout: float = 10.0) -> AssignmentCheck:
        def group_holds() -> bool:
            self.asked += 1
            return self.group_holds

        def rejoin() -> None:
            self.rejoined += 1

        return AssignmentCheck(lambda: self.holds, lambda: self.partitions, group_holds, rejoin, timeout,
                               lambda: self.now)


def test_a_group_that_holds_nothing_of_a_topic_with_partitions_rejoins_once_a_timeout():
    cluster = Cluster()
    check = cluster.check()
    cluster.now = 9.9
    assert not check.check() and cluster.asked == 0  # not yet: a join under way settles in seconds
    cluster.now = 10.0
    assert check.check() and cluster.rejoined == 1
    cluster.now = 15.0
    assert not check.check() and cluster.asked == 1  # asked again only a timeout later
    cluster.now = 20.0
    assert check.check() and cluster.rejoined == 2


def test_no_rejoin_while_it_holds_a_partition_another_member_holds_them_or_the_topic_has_none():
    cluster = Cluster()
    check = cluster.check()
    cluster.holds, cluster.now = True, 30.0
    assert not check.check() and cluster.asked == 0
    cluster.holds, cluster.now = False, 39.0  # held nothing since 30 s only
    assert not check.check() and cluster.asked == 0
    cluster.now, cluster.group_holds = 40.0, True  # more trainers than partitions: no gap
    assert not check.check() and cluster.asked == 1
    cluster.now, cluster.group_holds, cluster.partitions = 50.0, False, 0  # the topic not created yet
    assert not check.check() and cluster.rejoined == 0


def test_a_cluster_that_does_not_answer_is_asked_again_later():
    cluster = Cluster()
    check = cluster.check()

    def unanswered() -> bool:
        raise TimeoutError("no answer")

    check.group_holds = unanswered
    cluster.now = 10.0
    assert not check.check() and cluster.rejoined == 0
    check.group_holds = lambda: False
    cluster.now = 20.0
    assert check.check() and cluster.rejoined == 1
