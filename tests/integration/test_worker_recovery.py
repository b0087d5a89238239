"""Crashes and rebalances: every group still arrives exactly once, complete and in step order."""

from __future__ import annotations

from trajbus.consumers import BatchConsumer
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.snapshots import read_snapshots
from trajbus.streams.wire.topics import groups_topic
from trajbus.pipelines.synthetic import make_groups
from tests.helpers import assert_exactly_the_groups_sent, end_offsets, fetch_groups, settle_workers, wait_for


def emitted_so_far(bootstrap_servers: str, prefix: str) -> int:
    return sum(end_offsets(bootstrap_servers, groups_topic("train", prefix)))


def test_sigkill_of_the_only_worker_mid_run_then_restart(bootstrap_servers, prefix, start_worker):
    sent, stream = make_groups(500, 4, 3, seed=11)
    half = len(stream) // 2
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        worker = start_worker(n_rollouts=4)
        for start in range(0, half, 200):
            producer.submit_steps(stream[start:min(start + 200, half)], channel="train")
        wait_for(lambda: emitted_so_far(bootstrap_servers, prefix) >= 20, 90, "the worker to emit groups")
        worker.kill()  # SIGKILL: no commit, no flush, no goodbye
        killed_at = emitted_so_far(bootstrap_servers, prefix)
        for start in range(half, len(stream), 200):
            producer.submit_steps(stream[start:start + 200], channel="train")
    assert killed_at < 500, "the kill must land mid-run"
    restarted = start_worker(n_rollouts=4)

    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        groups = fetch_groups(consumer, 500, timeout=240)
        settle_workers(bootstrap_servers, prefix, [restarted])
        assert consumer.drain() == [], "a group arrived twice"
    assert_exactly_the_groups_sent(groups, sent)


def test_two_workers_on_8_partitions_one_killed(bootstrap_servers, prefix, start_worker):
    sent, stream = make_groups(500, 4, 3, seed=12)
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        first = start_worker(n_rollouts=4)
        second = start_worker(n_rollouts=4)
        wait_for(lambda: len(read_snapshots(bootstrap_servers, prefix)) >= 2, 90,
                 "both workers to be assigned and publishing statistics")
        for worker in (first, second):  # each says it shares the partitions, not silently (issue 36)
            wait_for(lambda log=worker.log_file: "one of 2 workers of group" in log.read_text(), 30,
                     f"{worker.log_file.name} to say it is one of 2 workers")
            assert "is overlapping" not in worker.log_file.read_text(), worker.log_tail()
        third = len(stream) // 3
        for start in range(0, third, 200):
            producer.submit_steps(stream[start:min(start + 200, third)], channel="train")
        wait_for(lambda: emitted_so_far(bootstrap_servers, prefix) >= 20, 90, "the workers to emit groups")
        second.kill()
        for start in range(third, len(stream), 200):
            producer.submit_steps(stream[start:start + 200], channel="train")

    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        groups = fetch_groups(consumer, 500, timeout=240)
        settle_workers(bootstrap_servers, prefix, [first])
        assert consumer.drain() == [], "a group arrived twice"
    assert_exactly_the_groups_sent(groups, sent)
