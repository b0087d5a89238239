"""The trajectory the trainer gets is the one the agent saw, through engine and broker faults.

A call that fails never leaves a step index the worker waits on, and a step the
broker acknowledges only after its call was answered 503 (or after a streaming
client gave up) never reaches the trainer: the trajectory's end names exactly the
steps whose calls succeeded, and an end whose own fate is unknown fences the
trajectory until the agent's retry sends it again. Broker faults are made by pausing a broker of this
test's own (SIGSTOP), so the session's broker is never disturbed.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

import httpx
import pytest
from transformers import AutoTokenizer

from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.gateway.errors import RETRY_SECONDS
from trajbus.infra.topics import ensure_topics
from trajbus.pipelines.processes import free_port, gateway_process, wait_http, worker_process
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.records import CONTINUES, Step, TrajectoryEnd
from trajbus.streams.wire.topics import steps_topic
from tests.helpers import decode_step_events, fetch_groups, read_to_end, wait_for

PUBLISH_TIMEOUT = "3"


def call(base_url: str, messages: list[dict], **options) -> httpx.Response:
    return httpx.post(f"{base_url}/chat/completions", json={"model": "tiny", "messages": messages, **options},
                      timeout=60)


def assistant(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}


def complete(trajectory: dict) -> httpx.Response:
    return httpx.post(f"{trajectory['base_url']}/complete_trajectory", json={"reward": 1.0}, timeout=60)


def once_kafka_is_back(send: Callable[[], httpx.Response]) -> httpx.Response:
    """What an agent does with a 503 ``kafka_unavailable`` (nothing was sent): retry after Retry-After
    (the gateway's first provisioning of a channel may take longer than the first retry, on a broker just
    resumed)."""
    def attempt() -> httpx.Response | None:
        response = send()
        unavailable = response.status_code == 503 and response.json()["error"]["code"] == "kafka_unavailable"
        return None if unavailable else response

    return wait_for(attempt, 60, "the broker to take the new channel", interval=RETRY_SECONDS)


def assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code and response.json()["error"]["message"]
    assert int(response.headers["retry-after"]) > 0


def test_a_call_failing_at_the_engine_leaves_no_index_behind(
        bootstrap_servers, prefix, scripted_engine, start_gateway, start_worker, tiny_model_dir):
    """Two concurrent calls on one trajectory, the first failing at the engine."""
    engine, record = scripted_engine([{"fail": "engine fault", "delay": 1.0}, "Second answer."])
    gateway, _ = start_gateway([engine])
    t = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "fault", "n_rollouts": 1}).json()
    messages = [{"role": "user", "content": "Hello?"}]
    failed: list[httpx.Response] = []
    first = threading.Thread(target=lambda: failed.append(call(t["base_url"], messages)))
    first.start()
    wait_for(lambda: record.exists() and record.read_text().count("\n") == 1, 30, "the engine to get the first call")
    second = call(t["base_url"], messages)  # sent while the first is still at the engine
    first.join(60)
    assert_openai_error(failed[0], 502, "backend_error")
    assert assistant(second)["content"] == "Second answer."
    done = complete(t).json()
    assert (done["steps"], done["step_indices"]) == (1, [0])

    start_worker(n_rollouts=1)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        [group] = fetch_groups(consumer, 1, timeout=60)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert [(s.step_index, s.reward, tokenizer.decode(s.response_ids[:-1])) for s in group.steps] == \
        [(0, 1.0, "Second answer.")]


def test_a_paused_broker_never_puts_a_reply_the_agent_did_not_get_into_its_trajectory(
        own_broker, prefix, scripted_engine, tiny_model_dir, tmp_path):
    broker = own_broker.read_state()
    servers = broker.bootstrap_servers
    replies = ["One.", "Two, never seen.", "Three, given up on.", "Four."]
    engine, _ = scripted_engine(replies)
    ensure_topics(servers, TopicSettings(prefix=prefix).channel_specs("fresh"))  # a channel is created explicitly
    port = free_port()
    gateway = gateway_process(servers, prefix, [engine], tiny_model_dir, port, tmp_path / "state",
                              tmp_path / "gateway.log", ["--publish-timeout", PUBLISH_TIMEOUT]).start()
    worker = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/ready", 120, gateway)
        t = httpx.post(f"{url}/init_trajectory", json={"prompt_uid": "paused", "n_rollouts": 1}).json()
        fresh = httpx.post(f"{url}/init_trajectory", json={"prompt_uid": "new", "channel": "fresh",
                                                            "n_rollouts": 1}).json()
        history = [{"role": "user", "content": "Count with me."}]
        history += [assistant(call(t["base_url"], history)), {"role": "user", "content": "Go on."}]

        os.kill(broker.pid, signal.SIGSTOP)
        assert_openai_error(call(t["base_url"], history), 503, "not_acknowledged")
        with pytest.raises(httpx.ReadTimeout):  # a streaming client that gives up while the step is unacknowledged
            with httpx.stream("POST", f"{t['base_url']}/chat/completions", timeout=httpx.Timeout(30, read=1.0),
                              json={"model": "tiny", "messages": history, "stream": True}) as stream:
                for _ in stream.iter_lines():
                    pass
        assert_openai_error(call(fresh["base_url"], history[:1]), 503, "kafka_unavailable")
        os.kill(broker.pid, signal.SIGCONT)

        retried = assistant(call(t["base_url"], history))  # the agent's retry, after Retry-After
        assert retried["content"] == "Four."
        assert assistant(once_kafka_is_back(lambda: call(fresh["base_url"], history[:1])))["content"] == "One."

        os.kill(broker.pid, signal.SIGSTOP)  # an end whose fate is unknown fences the trajectory
        assert_openai_error(complete(t), 503, "not_acknowledged")
        assert call(t["base_url"], history).json()["error"]["code"] == "conflict"
        os.kill(broker.pid, signal.SIGCONT)
        ends = [complete(x).json() for x in (t, fresh)]  # the agent's retry sends the same end
        assert [e["step_indices"] for e in ends] == [[0, 3], [0]]

        # The records of the failed calls did reach the broker, late: the two steps must stay out.
        sent = decode_step_events(read_to_end(servers, steps_topic("train", prefix)))
        assert sorted(s.step_index for s in sent if isinstance(s, Step)) == [0, 1, 2, 3]
        assert [e.steps for e in sent if isinstance(e, TrajectoryEnd)] == [[0, 3], [0, 3]]

        worker = worker_process(servers, prefix, tmp_path / "worker.log", channels="train,fresh",
                                n_rollouts=1).start()
        groups = {}
        for channel in ("train", "fresh"):
            with BatchConsumer(channel, servers, prefix=prefix) as consumer:
                [groups[channel]] = fetch_groups(consumer, 1, timeout=60)
    finally:
        if worker is not None:
            worker.stop()
        gateway.stop()

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    steps = groups["train"].steps
    assert [(s.step_index, tokenizer.decode(s.response_ids[:-1])) for s in steps] == [(0, "One."), (3, "Four.")]
    assert steps[1].metadata[CONTINUES] == 0
    assert steps[1].prompt_ids[:len(steps[0].prompt_ids) + len(steps[0].response_ids)] == \
        steps[0].prompt_ids + steps[0].response_ids
    [row] = VerlBackend(prompt_length=512, response_length=512, row_mode="trajectory").rows(steps)
    assert [t for t, m in zip(row.response, row.response_mask) if m] == steps[0].response_ids + steps[1].response_ids
    assert [s.step_index for s in groups["fresh"].steps] == [0]
