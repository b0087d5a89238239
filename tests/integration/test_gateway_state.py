"""The gateway's trajectory state stays bounded: idle trajectories are abandoned, finished ones removed."""

from __future__ import annotations

import httpx

from tests.helpers import wait_for


def test_idle_and_finished_trajectories_leave_the_state(scripted_engine, start_gateway):
    engine, _ = scripted_engine(["Four."])
    gateway, _ = start_gateway([engine], ["--idle-timeout", "3", "--finished-retention", "4"])
    trajectories = [httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": f"p{k}", "n_rollouts": 1}).json()
                    for k in range(6)]
    for t in trajectories:
        reply = httpx.post(f"{t['base_url']}/chat/completions", timeout=60,
                           json={"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}]})
        assert reply.status_code == 200, reply.text
    for t in trajectories[:3]:
        assert httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 1.0}).status_code == 200
    assert httpx.get(f"{gateway}/statistics").json()["trajectories"] == {"open": 3, "completed": 3}

    wait_for(lambda: httpx.get(f"{gateway}/statistics").json()["trajectories"].get("abandoned") == 3, 30,
             "the idle trajectories to be abandoned")
    late = httpx.post(f"{trajectories[4]['base_url']}/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "still there?"}]})
    assert late.status_code == 409 and "abandoned" in late.json()["error"]["message"], late.text
    wait_for(lambda: httpx.get(f"{gateway}/statistics").json()["trajectories"] == {}, 30, "the state to empty")
    duplicate = httpx.post(f"{trajectories[0]['base_url']}/complete_trajectory", json={"reward": 1.0})
    assert duplicate.status_code == 404 and duplicate.json()["error"]["code"] == "not_found"
    metrics = httpx.get(f"{gateway}/metrics").text
    assert 'trajbus_gateway_trajectories_total{event="abandoned"} 3.0' in metrics
    assert 'trajbus_gateway_state_trajectories{status="open"} 0.0' in metrics
    assert "trajbus_gateway_state_bytes " in metrics
