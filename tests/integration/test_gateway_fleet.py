"""Many gateways as one door: ``trajbus gateway --instances 2`` on one host, sharing only Kafka.

Any instance answers ``init_trajectory`` and hands out a base_url of its own; pacing
counts the groups in flight at every instance, each once wherever its rollouts run; an instance killed with SIGKILL costs
only its own agents a few 503s, after which their trajectories continue token-exactly.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai

from trajbus.consumers import BatchConsumer
from trajbus.gateway.admission.rules import BACKLOG_FULL
from trajbus.gateway.state.trajectories import RESERVED_STEPS
from trajbus.infra.local import free_ports
from trajbus.pipelines.processes import wait_http
from tests.helpers import fetch_groups, wait_for
from tests.integration.test_admission import assert_refused, init, sees
from tests.integration.test_multi_turn import assert_token_consistent

QUESTION = [{"role": "user", "content": "2+2?"}]
FOLLOW_UP = {"role": "user", "content": "And 3+3?"}


def first_turn(trajectory: dict) -> list[dict]:
    """An agent's first call; returns its history with the reply, as it sends it back."""
    client = openai.OpenAI(base_url=trajectory["base_url"], api_key="agent", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny", messages=QUESTION).choices[0].message
    return QUESTION + [{"role": "assistant", "content": reply.content}, FOLLOW_UP]


def call_until_answered(trajectory: dict, messages: list[dict], deadline_s: float) -> list[int]:
    """An agent whose instance is down: it retries as ``Retry-After`` says. Returns the statuses seen."""
    statuses: list[int] = []
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        response = httpx.post(f"{trajectory['base_url']}/chat/completions", timeout=60,
                              json={"model": "tiny", "messages": messages})
        statuses.append(response.status_code)
        if response.status_code != 503:
            return statuses
        assert response.json()["error"]["type"] == "service_unavailable", response.text
        time.sleep(float(response.headers["retry-after"]))
    raise AssertionError(f"no answer within {deadline_s}s: {statuses}")


def test_a_fleet_shares_one_pacing_bound_and_a_killed_instance_stops_only_its_own_trajectories(
        bootstrap_servers, prefix, scripted_engine, start_gateway, start_worker, tmp_path):
    engine, _ = scripted_engine(["Four.", "Six."])
    start_worker(n_rollouts=2)
    port = free_ports(3)
    door, fleet = start_gateway([engine], ["--instances", "2", "--max-backlog-groups", "2",
                                           "--max-admission-wait", "60"], port=port, state_dir=tmp_path / "fleet")
    instances = [f"http://127.0.0.1:{port + 1 + i}" for i in range(2)]
    for url in instances:
        wait_http(f"{url}/ready", 120, fleet)
    before = [httpx.get(f"{url}/statistics", timeout=10).json() for url in instances]
    assert [s["base_url"] for s in before] == instances
    assert len({s["instance"] for s in before}) == 2 and len({s["pid"] for s in before}) == 2
    assert f'trajbus_gateway_instance_info{{base_url="{instances[0]}"' in httpx.get(f"{instances[0]}/metrics").text

    # Any instance answers init_trajectory at the door; the base_url leads back to the one that holds the state.
    by_door = init(door, "p-0")
    assert by_door.status_code == 200, by_door.text
    first = next(url for url in instances if by_door.json()["base_url"].startswith(f"{url}/"))
    other = next(url for url in instances if url != first)
    own = {first: [by_door.json(), init(first, "p-0").json(), init(first, "p-1").json()],
           other: [init(other, "p-1").json()]}  # p-1's rollouts at both instances
    for url, trajectories in own.items():
        assert all(t["base_url"].startswith(f"{url}/") for t in trajectories)

    # One bound for the fleet: a group counts once, wherever its rollouts run.
    wait_for(lambda: sees(first, in_flight_here=2, in_flight_elsewhere=0, total=2), 30, "two groups at the first")
    wait_for(lambda: sees(other, in_flight_here=1, in_flight_elsewhere=1, total=2), 30, "two groups at the other")
    assert_refused(init(door, "p-new"), BACKLOG_FULL)

    histories = {t["trajectory_uid"]: first_turn(t) for trajectories in own.values() for t in trajectories}
    os.kill(before[0]["pid"], signal.SIGKILL)

    # The other instance's agents notice nothing: their second turn is answered at once.
    for t in own[instances[1]]:
        client = openai.OpenAI(base_url=t["base_url"], api_key="agent", max_retries=0, timeout=60)
        client.chat.completions.create(model="tiny", messages=histories[t["trajectory_uid"]])
    # The killed instance's agents get 503 until it is back, then continue.
    for t in own[instances[0]]:
        statuses = call_until_answered(t, histories[t["trajectory_uid"]], 120)
        assert statuses[-1] == 200 and set(statuses[:-1]) <= {503}, statuses
    restarted = httpx.get(f"{instances[0]}/statistics", timeout=10).json()
    assert restarted["pid"] != before[0]["pid"] and restarted["instance"] == before[0]["instance"]

    done = [httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 1.0}, timeout=60)
            for trajectories in own.values() for t in trajectories]
    assert [r.status_code for r in done] == [200] * 4, [r.text for r in done]
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as trainer:
        groups = fetch_groups(trainer, 2, timeout=90)
    assert sorted(g.prompt_uid for g in groups) == ["p-0", "p-1"]
    for group in groups:
        for uid in {s.trajectory_uid for s in group.steps}:
            trajectory = sorted((s for s in group.steps if s.trajectory_uid == uid), key=lambda s: s.step_index)
            killed = any(t["trajectory_uid"] == uid for t in own[instances[0]])  # goes on past its reservation
            assert [s.step_index for s in trajectory] == [0, 1 + RESERVED_STEPS if killed else 1]
            assert_token_consistent(trajectory)
