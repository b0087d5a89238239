"""ROLL's episode scheduler: the envs of a group share episode ids, then stop."""

from __future__ import annotations

from trajbus.pipelines.env_manager import EpisodeScheduler


def test_scheduler_gives_every_env_of_a_group_the_same_episodes_then_none():
    scheduler = EpisodeScheduler(episodes_per_group=3)
    assert [scheduler.get_episode_id(0, env) for env in (0, 1) for _ in range(4)] == [0, 1, 2, None] * 2
    scheduler = EpisodeScheduler()
    assert scheduler.get_episode_id(5, 0) == 0
    scheduler.stop()
    assert scheduler.get_episode_id(5, 0) is None
