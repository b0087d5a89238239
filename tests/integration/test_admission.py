"""Pacing: gateways hold new trajectories back while the trainer lags, and never cut a rollout.

The trainer's backlog (ready groups its consumer group has not committed, plus the groups
admitted trajectories will make, at every gateway) and the policy versions come from Kafka,
so two gateways on the same topics see the same backlog.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from trajbus.consumers import BatchConsumer
from trajbus.gateway.admission.rules import BACKLOG_FULL, POLICY_TOO_STALE
from trajbus.streams.client.policy import PolicyVersionPublisher
from tests.helpers import fetch_groups, wait_for

MARK = 2


def init(gateway: str, prompt_uid: str, wait: float | None = None, **body) -> httpx.Response:
    params = {"wait": wait} if wait is not None else None
    return httpx.post(f"{gateway}/init_trajectory", params=params, timeout=90,
                      json={"prompt_uid": prompt_uid, "n_rollouts": 2, **body})


def roll_out(trajectory: dict, reward: float = 1.0) -> None:
    """What an admitted agent does: a call, then its one submission."""
    reply = httpx.post(f"{trajectory['base_url']}/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}]})
    assert reply.status_code == 200, reply.text
    done = httpx.post(f"{trajectory['base_url']}/complete_trajectory", json={"reward": reward}, timeout=60)
    assert done.status_code == 200, done.text


def assert_refused(response: httpx.Response, reason: str) -> None:
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == reason and response.json()["error"]["type"] == "rate_limit_error"
    assert int(response.headers["retry-after"]) > 0


def backlog(gateway: str) -> dict | None:
    return httpx.get(f"{gateway}/statistics", timeout=10).json()["admission"].get("train", {}).get("backlog")


def sees(gateway: str, **expected: int) -> bool:
    seen = backlog(gateway)
    return seen is not None and all(seen[key] == value for key, value in expected.items())


def test_a_paused_trainer_holds_new_trajectories_back_at_every_gateway(
        bootstrap_servers, prefix, scripted_engine, start_gateway, start_worker, tmp_path: Path):
    engine, _ = scripted_engine(["Four."])
    start_worker(n_rollouts=2)
    flags = ["--max-backlog-groups", str(MARK), "--max-admission-wait", "60"]
    first, _ = start_gateway([engine], flags)
    second, _ = start_gateway([engine], flags, state_dir=tmp_path / "second-state")

    admitted = [init(first, "p1"), init(first, "p1"), init(first, "p2")]
    assert [r.status_code for r in admitted] == [200, 200, 200]
    assert_refused(init(first, "p3"), BACKLOG_FULL)  # two groups in flight: at the mark
    wait_for(lambda: sees(second, in_flight_elsewhere=2), 30, "the second gateway to see the first one's groups")
    assert_refused(init(second, "p4"), BACKLOG_FULL)
    bad_wait = init(first, "p3", wait=600)
    assert bad_wait.status_code == 400 and bad_wait.json()["error"]["param"] == "wait"

    # The rollouts in flight run to completion, and a further rollout of an admitted group is admitted.
    admitted.append(init(first, "p2"))
    assert admitted[-1].status_code == 200, admitted[-1].text
    for response in admitted:
        roll_out(response.json())
    wait_for(lambda: sees(first, ready=2, in_flight_here=0), 60, "the two groups to be ready")
    assert_refused(init(first, "p3"), BACKLOG_FULL)  # now the ready groups are the backlog
    wait_for(lambda: sees(second, ready=2, in_flight_elsewhere=0), 30, "the second gateway to see them ready")
    assert_refused(init(second, "p4"), BACKLOG_FULL)

    held: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: held.append(init(first, "p3", wait=60)))
    waiter.start()
    wait_for(lambda: "admission_waiting" in httpx.get(f"{first}/metrics").text and
             'trajbus_gateway_admission_waiting{channel="train",reason="backlog_full"} 1.0'
             in httpx.get(f"{first}/metrics").text, 30, "the request to be held")
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as trainer:  # the trainer resumes
        groups = fetch_groups(trainer, 2, timeout=60)
        trainer.commit()
    waiter.join(90)
    assert held and held[0].status_code == 200, held[0].text if held else "no answer"
    assert sorted(g.prompt_uid for g in groups) == ["p1", "p2"]  # nothing dropped: both groups, whole
    assert all(len(g.trajectory_uids) == 2 for g in groups)
    # The second gateway admits again too (one group, p3, in flight at the first).
    wait_for(lambda: sees(second, ready=0, in_flight_elsewhere=1), 30, "the second gateway to see the commit")
    assert init(second, "p4").status_code == 200
    metrics = httpx.get(f"{first}/metrics").text
    assert 'trajbus_gateway_admissions_total{channel="train",outcome="refused",reason="backlog_full"} 2.0' in metrics
    assert 'trajbus_gateway_admissions_total{channel="train",outcome="admitted",reason="waited"} 1.0' in metrics
    dashboard = httpx.get(f"{first}/dashboard/data", timeout=30).json()
    assert dashboard["admission"]["train"]["max_backlog_groups"] == MARK
    assert ["train", "refused", BACKLOG_FULL, 2] in dashboard["admissions"]


def test_new_trajectories_wait_while_the_engines_lag_the_trainer_past_the_bound(
        bootstrap_servers, prefix, scripted_engine, start_gateway, start_worker):
    engine, _ = scripted_engine(["Four."])
    start_worker(n_rollouts=1)
    gateway, _ = start_gateway([engine], ["--max-staleness", "1"])
    with PolicyVersionPublisher(bootstrap_servers, prefix=prefix) as trainer, \
            PolicyVersionPublisher(bootstrap_servers, prefix=prefix, serving=True) as engines:
        trainer.publish(0)
        engines.publish(0)
        running = init(gateway, "in-flight", n_rollouts=1)
        assert running.status_code == 200, running.text

        trainer.publish(2)  # the trainer is two versions ahead of what the engines serve
        wait_for(lambda: httpx.get(f"{gateway}/statistics").json()["policy_versions"].get("global") == 2, 30,
                 "the gateway to see version 2")
        assert_refused(init(gateway, "new", n_rollouts=1), POLICY_TOO_STALE)
        held: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: held.append(init(gateway, "new", wait=60, n_rollouts=1)))
        waiter.start()
        roll_out(running.json())  # the admitted trajectory finishes at its old version
        with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
            [group] = fetch_groups(consumer, 1, timeout=60)
        assert group.prompt_uid == "in-flight" and {s.policy_version for s in group.steps} == {0}
        assert not held  # still held: the engines still serve version 0

        engines.publish(2)  # the engines caught up
        waiter.join(90)
        assert held and held[0].status_code == 200, held[0].text if held else "no answer"
        roll_out(held[0].json())


def test_a_white_box_trajectory_is_admitted_at_its_first_generate(
        bootstrap_servers, prefix, scripted_engine, start_gateway, start_worker):
    engine, _ = scripted_engine(["Four."])
    start_worker(n_rollouts=1)
    gateway, _ = start_gateway([engine], ["--max-backlog-groups", "1"])

    def generate(uid: str, step_index: int, wait: float = 0) -> httpx.Response:
        return httpx.post(f"{gateway}/generate", params={"wait": wait}, timeout=90,
                          json={"prompt_ids": [1, 2, 3], "trajectory_uid": uid, "prompt_uid": f"p-{uid}",
                                "step_index": step_index, "max_tokens": 8})

    def submit(uid: str, out: dict) -> None:
        step = {"prompt_ids": [1, 2, 3], "response_ids": out["response_ids"], "rollout_log_probs": out["log_probs"],
                "trajectory_uid": uid, "prompt_uid": f"p-{uid}", "step_index": 0, "is_last": True, "reward": 1.0}
        response = httpx.post(f"{gateway}/submit_steps", json={"steps": [step], "n_rollouts": 1}, timeout=60)
        assert response.status_code == 200, response.text

    first = generate("a", 0)
    assert first.status_code == 200, first.text
    unnamed = httpx.post(f"{gateway}/generate", timeout=90, json={"prompt_ids": [1], "trajectory_uid": "z"})
    assert unnamed.status_code == 400 and unnamed.json()["error"]["code"] == "missing_prompt_uid", unnamed.text
    assert_refused(generate("b", 0), BACKLOG_FULL)
    under_way = generate("b", 1)  # a trajectory past its first call (e.g. before a gateway restart): never held
    assert under_way.status_code == 200, under_way.text
    submit("a", first.json())
    submit("b", under_way.json())
    wait_for(lambda: sees(gateway, ready=2, in_flight_here=0), 60, "both groups to be ready")
    assert_refused(generate("c", 0), BACKLOG_FULL)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as trainer:
        assert sorted(g.prompt_uid for g in fetch_groups(trainer, 2, timeout=60)) == ["p-a", "p-b"]
        trainer.commit()
    assert generate("c", 0, wait=60).status_code == 200
