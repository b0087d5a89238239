"""ROLL's GlobalDataset and env-manager protocol, reproduced; rollouts go through the gateway into trajbus."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trajbus.consumers import BatchConsumer, drain
from trajbus.infra.tiny_model import PRODUCTS
from trajbus.pipelines.agents import BlackBoxAgent, WhiteBoxAgent
from trajbus.pipelines.env_manager import EnvConfig, EnvManager, EpisodeScheduler, validation_pass
from trajbus.pipelines.envs import CalculatorEnv, MathEnv
from trajbus.pipelines.global_dataset import (GlobalDataset, GlobalDatasetManager, global_dataset_actor,
                                              global_dataset_manager_actor)
from trajbus.streams.client.producer import StepProducer
from tests.helpers import fetch_groups, wait_for

MATH = Path(__file__).resolve().parents[2] / "pipelines" / "data" / "math.jsonl"


def test_named_global_datasets_sample_traverse_and_reset(local_ray, prefix):
    ray, ray_namespace = local_ray, prefix

    train = global_dataset_actor("train_math", MATH, "sample", namespace=ray_namespace)
    again = global_dataset_actor("train_math", MATH, "sample", namespace=ray_namespace)  # get_if_exists
    items = ray.get([train.get_data_item.remote(seed) for seed in range(20)])
    assert items == ray.get([again.get_data_item.remote(seed) for seed in range(20)]), "same seed, same item"
    local = GlobalDataset(MATH)
    assert items == [local.items[random.Random(seed).randint(0, 99)] for seed in range(20)]
    assert len({json.dumps(i) for i in items}) > 1

    val = global_dataset_actor("val_math", MATH, "traversal", namespace=ray_namespace)
    manager = global_dataset_manager_actor(namespace=ray_namespace)
    ray.get(manager.register.remote("val_math", val))
    for _ in range(2):  # a second validation pass after the manager's reset
        seen = []
        while (item := ray.get(global_dataset_actor("val_math", MATH, namespace=ray_namespace)
                               .get_data_item.remote())) is not None:
            seen.append(item["prompt"])
        assert sorted(seen) == sorted(i["prompt"] for i in local.items), "every item exactly once"
        assert ray.get(val.get_data_item.remote()) is None
        assert ray.get(manager.reset.remote()) == 1
    with pytest.raises(ValueError, match="mode"):
        GlobalDataset(MATH, mode="shuffle")


def test_rollout_loops_submit_each_episode_once_into_trajbus(
        bootstrap_servers, prefix, inference_server, start_gateway, start_worker, tiny_model_dir, tmp_path):
    products = tmp_path / "products.jsonl"
    products.write_text("".join(json.dumps({"prompt": f"What is {a} * {b}?", "label": str(a * b)}) + "\n"
                                for a, b in PRODUCTS))
    gateway, _ = start_gateway([inference_server])
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
    start_worker(n_rollouts=8)
    scheduler = EpisodeScheduler(episodes_per_group=2)
    greedy = {"temperature": 0.0, "max_tokens": 40}
    managers = []
    for env_id in range(6):
        group_id = env_id // 2
        if group_id == 0:
            env, agent = MathEnv(GlobalDataset(MATH)), BlackBoxAgent(gateway)
        elif group_id == 1:
            env, agent = CalculatorEnv(GlobalDataset(products)), BlackBoxAgent(gateway, sampling=greedy)
        else:
            env, agent = MathEnv(GlobalDataset(MATH)), WhiteBoxAgent(gateway, str(tiny_model_dir))
        managers.append(EnvManager(env, agent, scheduler, EnvConfig(group_id, env_id, group_size=2)))
    with ThreadPoolExecutor(6) as pool:
        submitted = list(pool.map(lambda m: m.run_rollout_loop({"seed": 100}), managers))
    assert submitted == [2] * 6, "one submission per episode, and the loop ends when reset() returns None"
    for manager in managers:
        g = manager.env_config.group_id
        assert [e.prompt_uid for e in manager.episodes] == [f"{g}_{e}_{100 + g + e}" for e in (0, 1)]

    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        groups = {g.prompt_uid: g for g in fetch_groups(consumer, 6, timeout=120)}
    assert set(groups) == {f"{g}_{e}_{100 + g + e}" for g in range(3) for e in range(2)}
    for uid, group in groups.items():
        group_id, episode_id, seed = map(int, uid.split("_"))
        assert len(group.trajectory_uids) == 2
        firsts = [s for s in group.steps if s.step_index == 0]
        assert firsts[0].prompt_ids == firsts[1].prompt_ids, "the envs of a group roll out the same prompt"
        assert {s.metadata["traj_id"] for s in group.steps} == {f"{uid}_{env}" for env in (2 * group_id,
                                                                                         2 * group_id + 1)}
        assert all(s.metadata["episode_seed"] == seed == 100 + group_id + episode_id for s in group.steps)
        if group_id == 2:  # white-box: the trajectory uid is ROLL's trajectory id
            assert set(group.trajectory_uids) == {s.metadata["traj_id"] for s in group.steps}
        if group_id == 1:  # the calculator was called through the gateway, and the answer scored
            assert all(len([s for s in group.steps if s.trajectory_uid == t]) == 2 for t in group.trajectory_uids)
            assert [s.reward for s in group.steps if s.step_index == 1] == [1.0, 1.0]


def test_validation_pass_traverses_the_whole_set_each_time(
        bootstrap_servers, prefix, inference_server, start_gateway, start_worker, tiny_model_dir, tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n"
                           for i in range(5)))
    gateway, _ = start_gateway([inference_server])
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("val")
    start_worker(channels="val")
    dataset, datasets = GlobalDataset(val, mode="traversal"), GlobalDatasetManager()
    datasets.register("val", dataset)
    agent = WhiteBoxAgent(gateway, str(tiny_model_dir), channel="val", sampling={"max_tokens": 8})
    managers = [EnvManager(MathEnv(dataset), agent, EpisodeScheduler(), EnvConfig(g, g, group_size=1, tag="val"))
                for g in range(2)]
    for global_step in (0, 10):  # a fresh seed per pass: prompt uids derive from it
        episodes = validation_pass(managers, datasets, seed=global_step, val_batch_size=-1)
        assert len(episodes) == 5
        groups: list = []
        wait_for(lambda: groups.extend(drain("val", bootstrap_servers, prefix=prefix, timeout=30)) or len(groups) >= 5,
                 90, "the pass's 5 validation groups")
        labels = sorted(g.steps[0].metadata["label"] for g in groups)
        assert labels == [str(i + 1) for i in range(5)], "every validation item exactly once per pass"
