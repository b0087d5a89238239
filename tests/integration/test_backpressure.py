"""The queue bound: a paused trainer gets the newest groups, every other one is counted as dropped."""

from __future__ import annotations

from trajbus.consumers import BatchConsumer
from trajbus.infra.group_lag import consumer_group_lag
from trajbus.infra.topics import describe_topics
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.stats import summarize
from trajbus.streams.client.snapshots import read_snapshots
from trajbus.streams.wire.topics import groups_topic, trainer_group_id
from trajbus.pipelines.synthetic import make_groups
from tests.helpers import read_to_end, wait_for

MAX_QUEUE = 20


def test_paused_trainer_gets_newest_groups_and_drops_are_counted(bootstrap_servers, prefix, start_worker):
    sent, _ = make_groups(101, 2, 1, seed=5, window=1)  # window 1: groups complete in order
    order = sorted(sent)
    topic = groups_topic("train", prefix)
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        start_worker(n_rollouts=2, extra=["--max-queue-size", str(MAX_QUEUE)])
        with BatchConsumer("train", bootstrap_servers, prefix=prefix) as trainer:
            producer.submit_steps(sent[order[0]], channel="train")
            assert trainer.fetch_group(timeout=60).prompt_uid == order[0]
            trainer.commit()
            # The trainer pauses: it stays connected but fetches nothing while 5x the bound arrives.
            for uid in order[1:]:
                producer.submit_steps(sent[uid], channel="train")

            def settled() -> dict | None:
                row = summarize(read_snapshots(bootstrap_servers, prefix)).get("train", {})
                lag = sum(p.lag for p in consumer_group_lag(bootstrap_servers, trainer_group_id("train", prefix),
                                                            topic))
                return row if row.get("groups[emitted]") == 101 and lag <= MAX_QUEUE else None

            row = wait_for(settled, 120, "all groups emitted and the queue trimmed to its bound")
            retained = describe_topics(bootstrap_servers, names=[topic])[0]
            assert retained.records <= MAX_QUEUE, "the groups topic stays bounded"
            remaining = retained.records
            newest = [m.key().decode() for m in read_to_end(bootstrap_servers, topic)]  # by readiness
            assert len(newest) == remaining

            received = [group.prompt_uid for group in trainer.drain()]  # up to the log's end, known now

    dropped = wait_for(lambda: summarize(read_snapshots(bootstrap_servers, prefix))["train"]
                       .get("groups_dropped[queue_full]"), 30, "the drop count")
    assert dropped + remaining == 100, "every group after the first is either dropped or still queued"
    assert set(newest) <= set(received), "the trainer gets the newest groups"
    assert len(received) <= MAX_QUEUE + 5, "at most the bound, plus what was prefetched before the pause"
    assert len(set(received)) == len(received)
    assert row["groups[emitted]"] == 101
