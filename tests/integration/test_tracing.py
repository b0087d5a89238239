"""One trace per trajectory through the broker: a 3-turn trajectory of the official openai client through a traced
gateway and worker (``--tracing kafka``) to a traced ``BatchConsumer``; its spans, read back from
``{prefix}.traces``, form one connected trace with the names and parents of the design, and ``trajbus trace``
prints its timeline."""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import openai
import pytest

from trajbus.consumers import BatchConsumer
from trajbus.infra import tracing
from trajbus.infra.tiny_model import WEATHER_TOOL
from trajbus.infra.trace_export import SpanRecord, decode_span
from trajbus.streams.wire.topics import traces_topic
from tests.helpers import fetch_groups, read_to_end, trajbus
from tests.integration.test_multi_turn import REPLIES, agent, chat

TRACED = ["--tracing", "kafka"]
EXPECTED = {tracing.TRAJECTORY: 1, tracing.CALL: 3, tracing.ENGINE: 3, tracing.PUBLISH: 3, tracing.EMIT: 1,
            tracing.FETCH: 1}


def spans_of(bootstrap_servers: str, prefix: str, timeout: float = 30.0) -> list[SpanRecord]:
    """The traces topic read to its end, again until every expected span (and 3 steps applied + the end) is there."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [decode_span(m.value()) for m in read_to_end(bootstrap_servers, traces_topic(prefix))]
        names = Counter(s.name for s in spans)
        if all(names[n] >= count for n, count in EXPECTED.items()) and names[tracing.APPLY] >= 4:
            return spans
        assert time.monotonic() < deadline, f"spans so far: {dict(names)}"
        time.sleep(0.3)


def test_a_trajectory_is_one_connected_trace_from_the_agent_to_the_trainer(
        bootstrap_servers, prefix, scripted_engine, start_gateway, start_worker, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # the processes' span batches go out within 0.2 s
    start_worker(n_rollouts=1, extra=TRACED)
    engine, _ = scripted_engine(REPLIES)
    gateway, _ = start_gateway([engine], TRACED)
    trajectory = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "weather"}).json()
    client, uid = agent(trajectory["base_url"]), trajectory["trajectory_uid"]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = chat(client, messages, False, tools=[WEATHER_TOOL])
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sunny, 21 C"}]
    messages += [chat(client, messages, True, tools=[WEATHER_TOOL])]  # streamed: its spans end in its generator
    messages += [{"role": "user", "content": "Thanks!"}]
    chat(client, messages, False, tools=[WEATHER_TOOL])
    assert httpx.post(f"{trajectory['base_url']}/complete_trajectory", json={"reward": 1.0}).status_code == 200
    with BatchConsumer("train", bootstrap_servers, prefix=prefix, tracing="kafka") as consumer:
        [group] = fetch_groups(consumer, 1, timeout=60)
    assert group.trajectory_uids == [uid]  # the consumer's close flushed its spans

    spans = spans_of(bootstrap_servers, prefix)
    assert {s.trace_id for s in spans} == {format(tracing.trajectory_ids(uid)[0], "032x")}, "one trace"
    by_id = {s.span_id: s for s in spans}
    names = Counter(s.name for s in spans)
    assert {n: names[n] for n in EXPECTED} == EXPECTED and names[tracing.APPLY] == 4, names  # 3 steps + the end

    def parent(span: SpanRecord) -> str | None:
        assert span.parent_id is None or span.parent_id in by_id, f"{span.name}'s parent is missing"
        return by_id[span.parent_id].name if span.parent_id else None

    [root] = [s for s in spans if s.name == tracing.TRAJECTORY]
    assert root.span_id == format(tracing.trajectory_ids(uid)[1], "016x") and parent(root) is None
    assert Counter((s.name, parent(s)) for s in spans if s.name != tracing.TRAJECTORY) == {
        (tracing.CALL, tracing.TRAJECTORY): 3, (tracing.ENGINE, tracing.CALL): 3, (tracing.PUBLISH, tracing.CALL): 3,
        (tracing.APPLY, tracing.PUBLISH): 3, (tracing.APPLY, tracing.TRAJECTORY): 1,  # the end: sent outside a call
        (tracing.EMIT, tracing.APPLY): 1, (tracing.FETCH, tracing.EMIT): 1}
    assert len({s.parent_id for s in spans if s.name == tracing.PUBLISH}) == 3, "each call its own publish"
    services = {s.name: s.service for s in spans}
    assert (services[tracing.CALL], services[tracing.APPLY], services[tracing.FETCH]) == \
        ("trajbus-gateway", "trajbus-worker", "trajbus-trainer")

    printed = trajbus("trace", uid, "--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--json")
    assert printed.returncode == 0, printed.stderr
    timeline = json.dumps(json.loads(printed.stdout))
    for name in (tracing.CALL, tracing.PUBLISH, tracing.APPLY, tracing.EMIT, tracing.FETCH):
        assert name in timeline, name
