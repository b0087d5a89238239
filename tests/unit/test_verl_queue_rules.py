"""The verl queue's pure rules: which checkpoint a resume reads, when a policy version ends, the settings
and what goes on the samples topic."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from trajbus.consumers.verl.checkpoints import VersionClock, resume_version
from trajbus.consumers.verl.sample_log import decode, encode
from trajbus.consumers.verl.settings import VerlQueueSettings


def config(tmp_path: Path, mode: str = "auto", **trainer: object) -> object:
    return OmegaConf.create({
        "trainer": {"resume_mode": mode, "default_local_dir": str(tmp_path), "project_name": "math",
                    "experiment_name": "run 7/b", **trainer},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}},
        "async_training": {"require_batches": 2, "trigger_parameter_sync_step": 3}})


def test_the_resume_reads_the_checkpoint_verls_trainer_loads(tmp_path: Path) -> None:
    assert resume_version(config(tmp_path, "disable")) is None, "resume disabled: a fresh run"
    assert resume_version(config(tmp_path)) == 0, "no checkpoint yet: version 0"
    (tmp_path / "global_step_3").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    assert resume_version(config(tmp_path)) == 3
    assert resume_version(config(tmp_path, "resume_path", resume_from_path=str(tmp_path / "global_step_2"))) == 2


def test_a_version_ends_every_trigger_steps_of_required_samples(tmp_path: Path) -> None:
    clock = VersionClock.of(config(tmp_path), version=5)
    assert clock.samples_per_version == 4 * 2 * 3
    ends = [clock.tick() for _ in range(48)]
    assert [i + 1 for i, v in enumerate(ends) if v is not None] == [24, 48]
    assert [v for v in ends if v is not None] == [6, 7]


def test_settings_come_from_the_environment_and_name_a_wrong_one(tmp_path: Path) -> None:
    settings = VerlQueueSettings.from_env({"TRAJBUS_VERL_QUEUE": "groups", "TRAJBUS_VERL_PREFIX": "lab"})
    assert (settings.queue, settings.channel, settings.row_mode) == ("groups", "train", "trajectory")
    assert settings.samples_topic(config(tmp_path)) == "lab.verl.math.run-7-b"
    assert VerlQueueSettings(topic="mine").samples_topic(config(tmp_path)) == "mine"
    with pytest.raises(ValueError, match="TRAJBUS_VERL_QUEUE"):
        VerlQueueSettings.from_env({"TRAJBUS_VERL_QUEUE": "redis"})
    with pytest.raises(ValueError, match="channel"):
        VerlQueueSettings.from_env({"TRAJBUS_VERL_CHANNEL": "no spaces"})


@pytest.mark.parametrize("sample", [b"pickled by the rollouter", None, {"an": "object"}])
def test_what_is_put_is_what_is_got(sample: object) -> None:
    assert decode(*encode(sample)) == sample
