"""A busy engine is not a dead one (issue 31): an engine whose ``/health`` answers only after the gateway's
health check gave up, while it answers its calls, stays in service."""

from __future__ import annotations

import httpx

from trajbus.gateway.engine.pool import HEALTH_TIMEOUT
from tests.helpers import wait_for


def test_an_engine_slow_to_answer_its_health_check_keeps_answering_calls(prefix, scripted_engine, start_gateway):
    # The first call turns the engine's /health slower than the gateway's health check waits.
    engine, _ = scripted_engine([{"text": "4", "health_delay": HEALTH_TIMEOUT + 2}, "4"])
    gateway, _ = start_gateway([engine])  # a health check every 0.5 s
    answered: list[int] = []

    def slow_health_checks() -> int:
        [backend] = httpx.get(f"{gateway}/statistics").json()["backends"]
        return backend.get("slow_health_checks", 0)

    def one_more_call() -> bool:
        t = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": f"p{len(answered)}", "n_rollouts": 1})
        assert t.status_code == 200, t.text
        response = httpx.post(f"{t.json()['base_url']}/chat/completions", timeout=30,
                              json={"model": "tiny", "messages": [{"role": "user", "content": "What is 3 + 1?"}]})
        assert response.status_code == 200, f"call {len(answered)}: {response.status_code} {response.text}"
        assert response.json()["choices"][0]["message"]["content"] == "4"
        ready = httpx.get(f"{gateway}/ready")
        assert ready.status_code == 200, f"after call {len(answered)}: {ready.text}"
        answered.append(response.status_code)
        return True

    wait_for(lambda: one_more_call() and slow_health_checks() >= 1, 30,
             "a health check to get no answer in time while calls go on", interval=0.1)
    for _ in range(8):  # and on, through more health checks (one each 0.5 s)
        one_more_call()
    [backend] = httpx.get(f"{gateway}/statistics").json()["backends"]
    assert backend["healthy"] is True and backend["failures"] == 0 and backend["slow_health_checks"] >= 1
