"""SIGTERM drains a gateway as a load balancer needs: ``/ready`` flips to 503 while it still listens, new calls
get 503 with Retry-After, the calls in flight are answered (200, or 503 with Retry-After once the drain timeout
cuts them), never a broken connection; every 200's step is on Kafka, and the process exits 0."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from trajbus.streams.wire.topics import steps_topic
from tests.helpers import decode_step_events, read_to_end, wait_for

AGENTS = 6
DRAIN_DELAY, DRAIN_TIMEOUT = 2.0, 5.0
QUICK, SLOW = 5.0, 12.0
"""Engine seconds of the calls in flight at SIGTERM: half end after the gateway stopped listening (past the
drain delay) and are answered; half outlast the drain timeout and are cut."""


@dataclass
class Outcome:
    trajectory_uid: str
    sent: float
    answered: float
    status: int | None = None
    """None: the connection was refused (the gateway no longer listened: never accepted)."""
    response: httpx.Response | None = None
    error: str | None = None
    """Anything else: a connection broken mid-call, which must never happen."""


def agent(base_url: str, trajectory_uid: str, outcomes: list[Outcome]) -> None:
    """Calls one after another on one connection until a call is not answered 200."""
    with httpx.Client(timeout=60) as http:
        for turn in range(100):
            sent = time.monotonic()
            try:
                response = http.post(f"{base_url}/chat/completions",
                                     json={"model": "tiny", "messages": [{"role": "user", "content": f"Turn {turn}?"}]})
            except httpx.ConnectError:
                outcomes.append(Outcome(trajectory_uid, sent, time.monotonic()))
                return
            except Exception as exc:  # noqa: BLE001 (recorded and asserted against)
                outcomes.append(Outcome(trajectory_uid, sent, time.monotonic(), error=repr(exc)))
                return
            outcomes.append(Outcome(trajectory_uid, sent, time.monotonic(), response.status_code, response))
            if response.status_code != 200:
                return


def refused(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True


def assert_drained(response: httpx.Response) -> None:
    """503 with Retry-After and an OpenAI-shaped error, its connection closed."""
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) > 0 and response.headers["connection"] == "close"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "shutting_down") and error["message"], error


def test_sigterm_drains_calls_in_flight_and_exits_zero(
        bootstrap_servers, prefix, scripted_engine, start_gateway, tiny_model_dir):
    from transformers import AutoTokenizer

    half = AGENTS // 2
    replies = [f"Warm {k}." for k in range(AGENTS)] + [{"text": f"Quick {k}.", "delay": QUICK} for k in range(half)] \
        + [{"text": f"Slow {k}.", "delay": SLOW} for k in range(half)]
    engine, record = scripted_engine(replies, workers=AGENTS)
    gateway, process = start_gateway([engine], ["--drain-delay", str(DRAIN_DELAY),
                                                "--drain-timeout", str(DRAIN_TIMEOUT)])
    address = (urlsplit(gateway).hostname, urlsplit(gateway).port)
    trajectories = [httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": f"p{k}", "n_rollouts": 1}).json()
                    for k in range(AGENTS + 1)]
    late = trajectories.pop()
    outcomes: list[Outcome] = []
    agents = [threading.Thread(target=agent, args=(t["base_url"], t["trajectory_uid"], outcomes))
              for t in trajectories]
    for thread in agents:
        thread.start()
    wait_for(lambda: record.exists() and record.read_text().count("\n") >= 2 * AGENTS, 60,
             "every agent's second call to reach the engine")

    sigterm = time.monotonic()
    process.process.terminate()

    def unready() -> httpx.Response | None:
        response = httpx.get(f"{gateway}/ready")  # a refused connection fails the test: it must still listen
        return response if response.status_code == 503 else None

    ready = wait_for(unready, DRAIN_DELAY, "/ready to answer 503 while the gateway still listens")
    assert "draining" in ready.json()["reason"] and ready.json()["error"]["message"]
    assert_drained(httpx.post(f"{late['base_url']}/chat/completions", timeout=10,
                              json={"model": "tiny", "messages": [{"role": "user", "content": "Late?"}]}))
    wait_for(lambda: refused(address), 30, "the gateway to stop listening", interval=0.05)
    closed = time.monotonic()
    assert closed - sigterm >= DRAIN_DELAY - 0.5, "it stopped listening before the drain delay"
    assert process.process.wait(timeout=DRAIN_TIMEOUT + 30) == 0, process.log_tail()
    for thread in agents:
        thread.join(30)

    assert [o.error for o in outcomes if o.error] == [], "a call accepted was broken mid-call"
    in_flight = [o for o in outcomes if o.sent < sigterm < o.answered]
    assert sorted(o.status for o in in_flight) == [200] * half + [503] * half, [(o.status, o.error) for o in in_flight]
    assert all(o.answered > closed for o in in_flight), "the calls in flight were answered after it stopped listening"
    for outcome in outcomes:
        if outcome.status == 503:
            assert_drained(outcome.response)
        elif outcome.status is None:  # refused: only once it no longer listened, never accepted then dropped
            assert outcome.sent > sigterm
        else:
            assert outcome.status == 200, outcome.response.text
    answered = sorted((o.trajectory_uid, o.response.json()["choices"][0]["message"]["content"])
                      for o in outcomes if o.status == 200)
    assert len(answered) == AGENTS + half
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    steps = decode_step_events(read_to_end(bootstrap_servers, steps_topic("train", prefix)))
    assert sorted((s.trajectory_uid, tokenizer.decode(s.response_ids[:-1])) for s in steps) == answered, \
        "every 200 is a step on Kafka, and nothing else is"
    assert "gateway stopped: producer flushed" in process.log_tail(), process.log_tail()
