"""The gateway never answers 200 for a reply the engine did not finish (issue 35, item 1).

The gateway reads every engine call as a stream. An engine (or a proxy) that answers one JSON body
instead, or a stream that ends without ``[DONE]`` and a ``finish_reason``, must not become a 200
with an empty or truncated reply, nor a step for the trainer: the agent gets a 502 (an error event
when it streams), nothing reaches Kafka, and its retry is answered normally. A JSON body that is a
whole completion (ids and log-probs) is the answer itself. The scripted engine misbehaves on cue
(``infra.scripted_engine.Misbehaving``).
"""

from __future__ import annotations

import httpx
import orjson
import pytest
from transformers import AutoTokenizer

from trajbus.infra.scripted_engine import log_probs, noncanonical_ids
from trajbus.streams.wire.records import Step
from trajbus.streams.wire.topics import steps_topic
from tests.helpers import decode_step_events, read_to_end

USER = [{"role": "user", "content": "Hello?"}]
RETRIED = "Retried."


def init(gateway: str) -> str:
    """A one-rollout trajectory; its OpenAI base URL."""
    response = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "unfinished", "n_rollouts": 1})
    assert response.status_code == 200, response.text
    return response.json()["base_url"]


def call(base_url: str, **options) -> httpx.Response:
    return httpx.post(f"{base_url}/chat/completions", json={"model": "tiny", "messages": USER, **options}, timeout=30)


def streamed_events(base_url: str) -> list[bytes]:
    """The payload of every ``data:`` event of a streaming call, in order."""
    with httpx.stream("POST", f"{base_url}/chat/completions", timeout=30,
                      json={"model": "tiny", "messages": USER, "stream": True}) as response:
        assert response.status_code == 200
        return [line[5:].strip().encode() for line in response.iter_lines() if line.startswith("data:")]


def published(bootstrap_servers: str, prefix: str) -> list[Step]:
    """Every step on the channel's steps topic, read to its end offsets."""
    return [e for e in decode_step_events(read_to_end(bootstrap_servers, steps_topic("train", prefix)))
            if isinstance(e, Step)]


def assert_engine_fault(response: httpx.Response) -> None:
    """502 with an OpenAI-shaped error body naming the backend."""
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "backend_error" and error["type"] == "backend_error" and error["message"]


def assert_only_the_retry_published(bootstrap_servers: str, prefix: str, tokenizer) -> None:
    """The failed call left no step and no index: the retry's step is the trajectory's first."""
    steps = published(bootstrap_servers, prefix)
    assert [(s.step_index, tokenizer.decode(s.response_ids, skip_special_tokens=True)) for s in steps] == \
        [(0, RETRIED)]


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_whole_json_completion_to_a_stream_request_is_the_answer(
        bootstrap_servers, prefix, scripted_engine, start_gateway, tokenizer):
    engine, _ = scripted_engine([{"text": "Whole answer.", "unstreamed": "whole"}])
    gateway, _ = start_gateway([engine])
    base_url = init(gateway)
    response = call(base_url)
    assert response.status_code == 200, response.text
    ids = noncanonical_ids(tokenizer, "Whole answer.") + [tokenizer.eos_token_id]
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "Whole answer."
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(ids)
    [step] = published(bootstrap_servers, prefix)
    assert step.response_ids == ids
    assert step.rollout_log_probs == pytest.approx(log_probs(len(ids)))


@pytest.mark.parametrize("unfinished", [{"text": "No ids.", "unstreamed": "bare"},
                                        {"text": "Cut short here.", "break_after": 2}],
                         ids=["a JSON body without ids or log-probs", "a stream that breaks off"])
def test_an_unfinished_reply_is_a_502_and_no_step(
        bootstrap_servers, prefix, scripted_engine, start_gateway, tokenizer, unfinished):
    """One JSON body a step cannot be captured from, or a stream without ``[DONE]``: the engine's fault."""
    engine, _ = scripted_engine([unfinished, RETRIED])
    gateway, _ = start_gateway([engine])
    base_url = init(gateway)
    assert_engine_fault(call(base_url))
    assert published(bootstrap_servers, prefix) == []
    assert call(base_url).json()["choices"][0]["message"]["content"] == RETRIED
    assert_only_the_retry_published(bootstrap_servers, prefix, tokenizer)


def test_a_streaming_agent_gets_an_error_event_not_a_truncated_reply(
        bootstrap_servers, prefix, scripted_engine, start_gateway, tokenizer):
    engine, _ = scripted_engine([{"text": "Cut short here.", "break_after": 3}, RETRIED])
    gateway, _ = start_gateway([engine])
    base_url = init(gateway)
    events = streamed_events(base_url)
    assert b"[DONE]" not in events
    *chunks, last = [orjson.loads(e) for e in events]
    assert not any(c["choices"][0]["finish_reason"] for c in chunks)
    assert last["error"]["code"] == "backend_error" and last["error"]["message"]
    assert published(bootstrap_servers, prefix) == []

    events = streamed_events(base_url)  # the agent's retry
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == RETRIED
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert_only_the_retry_published(bootstrap_servers, prefix, tokenizer)


def test_generate_takes_a_whole_json_completion_and_refuses_an_unfinished_reply(
        scripted_engine, start_gateway, tokenizer):
    engine, _ = scripted_engine([{"text": "Cut short here.", "break_after": 2},
                                 {"text": "No ids.", "unstreamed": "bare"},
                                 {"text": "Whole answer.", "unstreamed": "whole"}])
    gateway, _ = start_gateway([engine])

    def generate() -> httpx.Response:
        return httpx.post(f"{gateway}/generate", json={"prompt_ids": [1, 2, 3]}, timeout=30)

    assert_engine_fault(generate())
    assert_engine_fault(generate())
    whole = generate()
    assert whole.status_code == 200, whole.text
    ids = noncanonical_ids(tokenizer, "Whole answer.") + [tokenizer.eos_token_id]
    assert whole.json()["response_ids"] == ids and whole.json()["finish_reason"] == "stop"
    assert whole.json()["log_probs"] == pytest.approx(log_probs(len(ids)))
