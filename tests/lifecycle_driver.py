"""The two processes of the crash-and-resume test, each resumable: ``python -m tests.lifecycle_driver``.

``driver``: a slime data source on the prompt ledger keeps ``--in-flight`` groups rolling out
ahead of the trainer, until the epoch is handed out; each rollout writes its steps and its end
(the second rollout of a group is slower, so a kill finds groups half done). Prints
``dispatched <uid>`` and ``rollout <uid> <i>``.

``trainer``: fetches groups and "trains" them, a group a step on the trained log: the prompt of each
goes into the trained list, which is saved with the ``TrainingState`` every ``--every`` groups (a
checkpoint, written whole, then ``checkpoint <n>`` is printed). Ends once every prompt of the epoch is trained or
dropped, writing ``done.json``. A restart resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trajbus.consumers import BatchConsumer
from trajbus.pipelines.data_source import DataSourceArgs, RolloutDataSourceWithBuffer, Sample
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.training_state import TrainingState
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.topic_settings import TopicSettings


_SAY = threading.Lock()
RUN = "lifecycle"
"""The trainer's run on the trained log."""


def say(line: str) -> None:
    """One whole line on stdout (print from several threads can interleave its text and newline)."""
    with _SAY:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def prompt_of(prompt_uid: str) -> int:
    """The dataset offset a prompt uid names (``p<fingerprint>-e<epoch>-o<offset>[~attempt]``)."""
    return int(prompt_uid.split("-o")[-1].split("~")[0])


def roll_out(producer: StepProducer, sample: Sample, rollout: int, seconds: float) -> None:
    uid = f"{sample.prompt_uid}/{rollout}"
    time.sleep(seconds * (3 if rollout else 1))
    producer.submit_steps([{"prompt_ids": [1, 2, 3], "response_ids": [4, 5, sample.index % 200 + 6],
                            "trajectory_uid": uid, "prompt_uid": sample.prompt_uid, "step_index": 0,
                            "rollout_log_probs": [-0.1, -0.2, -0.3], "n_rollouts": 2}])
    producer.complete_trajectory(uid, sample.prompt_uid, reward=float(rollout), n_rollouts=2)
    say(f"rollout {sample.prompt_uid} {rollout}")


def drive(options: argparse.Namespace) -> None:
    args = DataSourceArgs(prompt_data=options.data, n_samples_per_prompt=2)
    settings = TopicSettings(prefix=options.prefix)
    with PromptLedger(options.bootstrap_servers, "train", options.prefix) as ledger, \
            StepProducer(options.bootstrap_servers, settings=settings) as producer, \
            ThreadPoolExecutor(options.in_flight * 2) as pool:
        source = RolloutDataSourceWithBuffer(args, ledger=ledger)
        size = len(source.dataset)
        slots = threading.Semaphore(options.in_flight)
        running = []
        while source.due or (source.epoch_id == 0 and source.sample_offset < size):
            slots.acquire()
            group = source.get_samples(1)[0]
            say(f"dispatched {group[0].prompt_uid}")
            rollouts = [pool.submit(roll_out, producer, sample, i, options.seconds) for i, sample in enumerate(group)]
            running += rollouts
            threading.Thread(target=lambda r=rollouts: ([f.result() for f in r], slots.release()),
                             daemon=True).start()
        for rollout in running:
            rollout.result()
    say("handed out")


def train(options: argparse.Namespace) -> None:
    checkpoint = Path(options.checkpoint_dir) / "checkpoint.json"
    with BatchConsumer("train", options.bootstrap_servers, prefix=options.prefix, rank=0, world_size=1) as consumer, \
            PromptLedger(options.bootstrap_servers, "train", options.prefix) as ledger, \
            TrainingState(consumer, ledger, run=RUN) as state:
        trained: list[str] = []
        if checkpoint.exists():
            saved = json.loads(checkpoint.read_text())
            state.load_state_dict(saved["state"])
            trained = saved["trained"]
        while True:
            group = consumer.fetch_group(timeout=0.5)
            if group is not None:
                trained.append(group.prompt_uid)
                state.record_step()  # a group a step: on the trained log before any checkpoint of it
                if len(trained) % options.every == 0:
                    tmp = checkpoint.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"state": state.state_dict(), "trained": trained}))
                    os.replace(tmp, checkpoint)
                    say(f"checkpoint {len(trained)}")
                continue
            ledger.refresh()
            view = ledger.view
            dropped = {prompt_of(uid) for uid in view.dispatched if view.dropped_for(uid) not in (None, "abandoned")}
            if len({prompt_of(uid) for uid in trained} | dropped) >= options.prompts:
                Path(options.checkpoint_dir, "done.json").write_text(json.dumps(
                    {"trained": trained, "drops": {uid: view.dropped_for(uid) for uid in view.dispatched
                                                   if view.dropped_for(uid) is not None},
                     "depth": state.depth()}))
                say("done")
                return


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["driver", "trainer"])
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--data")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=0.1)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64)
    options = parser.parse_args()
    drive(options) if options.role == "driver" else train(options)


if __name__ == "__main__":
    main()
