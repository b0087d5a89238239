"""The trainer of the step test, resumable: ``python -m tests.step_trainer``.

Trains ``--steps`` steps of ``--groups`` groups each (``fetch_dataproto``), records each step on the trained
log with the policy version it trained against, and writes the batch each step got (``batch-<N>.pt``, the
tensors and the non-tensor columns) before saving a checkpoint every ``--every`` steps; prints
``trained <N>`` after each step. ``--hold-after N``: after step N it waits to be killed (past a
checkpoint, before the next). A restart resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

import torch

from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.training_state import TrainingState

RUN = "step-test"
BACKEND = {"prompt_length": 512, "response_length": 64}


def save_batch(batch, path: Path) -> None:
    """The tensors and non-tensor columns the step trained, written whole."""
    tmp = path.with_suffix(".tmp")
    torch.save({"tensors": {key: batch.batch[key] for key in batch.batch.keys()},
                "columns": {key: list(value) for key, value in batch.non_tensor_batch.items()}}, tmp)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--hold-after", type=int)
    options = parser.parse_args()
    folder = Path(options.dir)
    checkpoint = folder / "checkpoint.json"
    with BatchConsumer("train", options.bootstrap_servers, prefix=options.prefix, rank=0, world_size=1,
                       backend=VerlBackend(**BACKEND)) as consumer, \
            PromptLedger(options.bootstrap_servers, "train", options.prefix) as ledger, \
            TrainingState(consumer, ledger, run=RUN) as state:
        if checkpoint.exists():
            state.load_state_dict(json.loads(checkpoint.read_text()))
        while state.step < options.steps:
            version = state.step  # the policy the step's update starts from
            batch = consumer.fetch_dataproto(options.groups, timeout=120, current_version=version)
            if batch is None:
                sys.exit(f"step {state.step + 1}: no batch within 120 s")
            save_batch(batch, folder / f"batch-{state.step + 1}.pt")
            state.record_step(policy_version=version)
            if state.step % options.every == 0:
                tmp = checkpoint.with_suffix(".tmp")
                tmp.write_text(json.dumps(state.state_dict()))
                os.replace(tmp, checkpoint)
            print(f"trained {state.step}", flush=True)
            if state.step == options.hold_after:
                threading.Event().wait()  # until the test kills this process


if __name__ == "__main__":
    main()
