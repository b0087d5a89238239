"""verl's fully-async trainer on trajbus's queue: kill -9 of the trainer mid-mini-batch, then of the trainer
and the rollouter together, each resumed from the last checkpoint; every sample put is trained once."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import read_to_end, wait_for
from trajbus.pipelines.processes import ServiceProcess

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = 4
"""Samples per training step (the driver's ppo_mini_batch_size * require_batches)."""


def role(name: str, servers: str, prefix: str, tmp_path: Path, *extra: str) -> ServiceProcess:
    count = len(list(tmp_path.glob(f"{name}*.log")))
    return ServiceProcess([name, "--checkpoint-dir", str(tmp_path / "checkpoints"), "--experiment", "run", *extra],
                          tmp_path / f"{name}{count}.log", module="tests.verl_crash_driver",
                          env={"PYTHONPATH": str(ROOT), "TRAJBUS_BOOTSTRAP_SERVERS": servers,
                               "TRAJBUS_VERL_PREFIX": prefix}).start()


def lines(process: ServiceProcess, word: str) -> list[list[int]]:
    return [[int(x) for x in line.split()[1:]] for line in process.log_file.read_text().splitlines()
            if line == word or line.startswith(word + " ")]


def mid_mini_batch(trainer: ServiceProcess, after_checkpoint: int) -> bool:
    """The trainer passed checkpoint ``after_checkpoint`` and holds part of its next step's samples."""
    checkpoints = lines(trainer, "checkpoint")
    got = lines(trainer, "got")
    return bool(checkpoints) and checkpoints[-1][0] >= after_checkpoint and bool(got) and got[-1][1] == 2


def end_the_epoch(servers: str, prefix: str, tmp_path: Path, rollouter: ServiceProcess) -> ServiceProcess:
    """Stop ``rollouter``, put samples up to a whole step and the sentinel, and run a resumed trainer to the end."""
    rollouter.kill()
    put = read_to_end(servers, f"{prefix}.verl.crash.run")
    more = REQUIRED - len(put) % REQUIRED + REQUIRED
    rollouter = role("rollouter", servers, prefix, tmp_path, "--first", "1000", "--count", str(more), "--end")
    trainer = role("trainer", servers, prefix, tmp_path)
    try:
        wait_for(lambda: lines(trainer, "done") == [[]] or not trainer.alive(), 180, "the trainer at the sentinel")
        assert lines(trainer, "done") == [[]], trainer.log_tail()
        return trainer
    finally:
        rollouter.kill()
        trainer.kill()


def assert_trained_once(servers: str, prefix: str, tmp_path: Path) -> None:
    """The trained samples, read from the checkpoints of the final lineage, are the samples put: each once."""
    from tests.verl_crash_driver import sample_id

    produced = [sample_id(record.value()) for record in read_to_end(servers, f"{prefix}.verl.crash.run")
                if record.value() is not None]
    checkpoints = tmp_path / "checkpoints"
    last = int((checkpoints / "latest_checkpointed_iteration.txt").read_text())
    trained = [i for v in range(1, last + 1)
               for i in json.loads((checkpoints / f"global_step_{v}" / "trained.json").read_text())]
    assert len(produced) % REQUIRED == 0 and len(produced) > 16
    assert trained == produced, "every sample put is trained once, in the order put: none lost, none twice"
    handed_out = sum(len(lines(ServiceProcess([], log), "got")) for log in tmp_path.glob("trainer*.log"))
    assert handed_out > len(trained), "the kills hit mid-mini-batch: samples handed out after a checkpoint came again"


def test_kill_the_trainer_then_both_and_every_sample_is_trained_once(bootstrap_servers, prefix, tmp_path):
    rollouter = role("rollouter", bootstrap_servers, prefix, tmp_path, "--first", "0", "--count", "400",
                     "--seconds", "0.1")
    trainer = role("trainer", bootstrap_servers, prefix, tmp_path)
    try:
        # 1. the trainer, mid-mini-batch after its second checkpoint
        wait_for(lambda: mid_mini_batch(trainer, 2), 180, "the trainer mid-mini-batch after checkpoint 2")
        trainer.kill()
        trainer = role("trainer", bootstrap_servers, prefix, tmp_path)

        # 2. both, the resumed trainer again mid-mini-batch and the rollouter mid-production
        wait_for(lambda: mid_mini_batch(trainer, 4), 180, "the resumed trainer mid-mini-batch after checkpoint 4")
        trainer.kill()
        end_the_epoch(bootstrap_servers, prefix, tmp_path, rollouter)
    finally:
        rollouter.kill()
        trainer.kill()
    assert_trained_once(bootstrap_servers, prefix, tmp_path)
