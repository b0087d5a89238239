"""BatchConsumer against the real broker and worker: DataProto batches, checkpoints, validation drains."""

from __future__ import annotations


import pytest

from trajbus.consumers import BatchConsumer, UnknownChannel, drain
from trajbus.consumers.backends import VerlBackend
from trajbus.infra.topics import describe_topics, ensure_topics
from trajbus.pipelines.synthetic import make_groups
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.topics import groups_topic
from tests.helpers import fetch_groups, through_worker, wait_for


def test_fetch_dataproto_through_the_real_broker_and_worker(bootstrap_servers, prefix, start_worker):
    sent, stream = make_groups(3, 2, 2, seed=4)
    through_worker(bootstrap_servers, prefix, start_worker, stream, n_rollouts=2)
    backend = VerlBackend(prompt_length=16, response_length=8)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix, backend=backend) as consumer:
        batch = consumer.fetch_dataproto(n_groups=2, timeout=60)
        assert consumer.fetch_dataproto(n_groups=2, timeout=3) is None  # only one group left: held back
        rest = consumer.fetch_dataproto(n_groups=1, timeout=10)
    assert len(batch) == 8 and len(rest) == 4  # one row per step: 2 trajectories x 2 steps per group
    uids = list(batch.non_tensor_batch["uid"]) + list(rest.non_tensor_batch["uid"])
    assert sorted(set(uids)) == sorted(sent) and all(uids.count(u) == 4 for u in sent)


TRAINER = """
import json, os, signal, sys, time
from trajbus.consumers import BatchConsumer
servers, prefix, out = sys.argv[1:4]
consumer = BatchConsumer("train", servers, prefix=prefix)
used = []
while len(used) < 5:
    group = consumer.fetch_group(timeout=60)
    used.append(group.prompt_uid)
consumer.commit()
checkpoint = {"data": consumer.state_dict(), "used": list(used)}  # saved with the weights
while len(used) < 8:  # trains on three more groups and commits them, but never checkpoints again
    used.append(consumer.fetch_group(timeout=60).prompt_uid)
consumer.commit()
with open(out, "w") as f:
    json.dump(checkpoint, f)
print("ready", flush=True)
time.sleep(600)
"""


def test_sigkilled_trainer_resumes_from_its_checkpoint_exactly(bootstrap_servers, prefix, start_worker, tmp_path):
    import json
    import subprocess
    import sys

    sent, stream = make_groups(20, 2, 1, seed=6)
    through_worker(bootstrap_servers, prefix, start_worker, stream, n_rollouts=2)
    out = tmp_path / "checkpoint.json"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, bootstrap_servers, prefix, str(out)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "ready"
    finally:
        trainer.kill()  # SIGKILL between its last commit and any further checkpoint
        trainer.wait()
    checkpoint = json.loads(out.read_text())
    trained = list(checkpoint["used"])
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as restarted:
        restarted.load_state_dict(checkpoint["data"])
        trained += [g.prompt_uid for g in fetch_groups(restarted, 15, timeout=60)]
        assert restarted.drain() == [], "every group of the topic was trained on"
    assert sorted(trained) == sorted(sent) and len(set(trained)) == 20


def test_validation_channel_is_drained_once_and_isolated(bootstrap_servers, prefix, start_worker):
    val_sent, val_stream = make_groups(3, 1, 2, seed=7, tag="v")
    train_sent, train_stream = make_groups(2, 2, 1, seed=8, tag="t")
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        producer.provision("val")
        start_worker(channels="train,val", n_rollouts=2, extra=["--channel-setting", "val.n_rollouts=1"])
        producer.submit_steps(val_stream, channel="val")
        producer.submit_steps(train_stream, channel="train")
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as trainer:
        assert sorted(g.prompt_uid for g in fetch_groups(trainer, 2, timeout=60)) == sorted(train_sent)

    wait_for(lambda: describe_topics(bootstrap_servers, names=[groups_topic("val", prefix)])[0].records == 3, 60,
             "the three validation groups to be ready")
    first = drain("val", bootstrap_servers, prefix=prefix)
    assert sorted(g.prompt_uid for g in first) == sorted(val_sent)
    assert drain("val", bootstrap_servers, prefix=prefix) == []


def test_verl_grpo_on_groups_that_came_through_the_broker(bootstrap_servers, prefix, start_worker):
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    sent, stream = make_groups(2, 4, 2, seed=10)  # trajectory r of each group is rewarded r
    through_worker(bootstrap_servers, prefix, start_worker, stream, n_rollouts=4)
    backend = VerlBackend(prompt_length=16, response_length=8)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix, backend=backend) as consumer:
        batch = consumer.fetch_dataproto(n_groups=2, timeout=60)
    advantages, _ = compute_grpo_outcome_advantage(token_level_rewards=batch.batch["rm_scores"],
                                                   response_mask=batch.batch["response_mask"],
                                                   index=batch.non_tensor_batch["uid"])
    # By hand: a step row's score is its own reward (0 on first steps, r on last steps),
    # normalised within its prompt group with the unbiased std.
    scores = batch.batch["rm_scores"].sum(dim=-1)
    mask = batch.batch["response_mask"].bool()
    for uid in sent:
        rows = [i for i, u in enumerate(batch.non_tensor_batch["uid"]) if u == uid]
        group = scores[rows]
        expected = (group - group.mean()) / (group.std() + 1e-6)
        for row, value in zip(rows, expected):
            assert torch.allclose(advantages[row][mask[row]], value.expand(int(mask[row].sum())), atol=1e-5)


def test_a_commit_the_group_refuses_for_a_lost_member_is_made_once_the_trainer_rejoined(bootstrap_servers,
                                                                                         prefix, start_worker):
    """Arranged, not waited for: a second consumer joins the trainer's group and the trainer does not poll
    within the rebalance's limit (its ``max.poll.interval.ms``, 10 s here), so the group goes on without it,
    as a dead coordinator's node leaves a member whose session ran out. Its commit then is refused for an
    unknown member: no exception reaches the loop, the commit is made at a later fetch, once the trainer
    joined again, and the trainer hands out no group twice (it reads on from its own position)."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    from trajbus.infra.clients import reader

    sent, stream = make_groups(4, 2, 1, seed=5)
    through_worker(bootstrap_servers, prefix, start_worker, stream, n_rollouts=2)
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, "log_level": 0})
    with BatchConsumer("train", bootstrap_servers, prefix=prefix, **{"max.poll.interval.ms": 10000}) as trainer:
        probe = reader(bootstrap_servers, {"group.id": trainer.group_id})
        got = [group.prompt_uid for group in fetch_groups(trainer, 1, 60)]
        position = {int(p): o for p, o in trainer.state_dict()["positions"].items()}

        def committed() -> dict[int, int]:
            asked = [TopicPartition(trainer.topic, p) for p in position]
            return {tp.partition: tp.offset for tp in probe.committed(asked, timeout=10)}

        def members() -> int:
            return len(admin.describe_consumer_groups([trainer.group_id])[trainer.group_id].result(timeout=10).members)

        with BatchConsumer("train", bootstrap_servers, prefix=prefix) as joining:
            wait_for(lambda: joining.fetch_group(timeout=0.5) is None and members() == 1, 60,
                     "the group gone on without the trainer")
            trainer.commit()  # refused: the group no longer knows the trainer; no exception
            assert committed() != position
        # the other member left: the trainer, rejoining at its next fetch, holds every partition again

        def fetch_until_committed() -> bool:
            group = trainer.fetch_group(0.5)
            if group is not None:
                got.append(group.prompt_uid)
            return committed() == position

        wait_for(fetch_until_committed, 60, "the refused commit made once the trainer rejoined")
        probe.close()
    assert len(got) == len(set(got)), "the trainer handed a group out twice"


def test_a_channel_without_topics_is_refused_naming_the_channels_there_and_the_fix(bootstrap_servers, prefix):
    """``BatchConsumer("trian")`` beside ``train`` and ``val``: once the topic had its grace to appear
    (``channel_grace``; a worker may be creating it), the fetch raises ``UnknownChannel`` (a ``LookupError``),
    not ``None`` after its 60 s; a first fetch shorter than the grace returns ``None`` and the next one raises.
    Once the channel is created, the same consumer's next fetch waits for groups as usual."""
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        producer.provision("val")
    fix = f"`trajbus topics --create --channels trian --prefix {prefix}`"
    with BatchConsumer("trian", bootstrap_servers, prefix=prefix, channel_grace=3) as consumer:
        with pytest.raises(UnknownChannel) as refused:  # raised during the fetch: not None at its end
            consumer.fetch_group(timeout=60)
        message = str(refused.value)
        assert isinstance(refused.value, LookupError), message
        assert f"there is no topic {groups_topic('trian', prefix)} at {bootstrap_servers}" in message, message
        assert "(channels there: train, val)" in message and fix in message, message
        ensure_topics(bootstrap_servers, TopicSettings(prefix=prefix).channel_specs("trian"))
        assert consumer.fetch_group(timeout=1) is None, "a channel created since is read"
    with BatchConsumer("tiran", bootstrap_servers, prefix=prefix, channel_grace=3) as consumer:
        assert consumer.fetch_batch(timeout=1) is None, "within the grace: a worker may be creating the topics"
        with pytest.raises(UnknownChannel, match="channels there: train, trian, val"):
            consumer.fetch_batch(timeout=60)
