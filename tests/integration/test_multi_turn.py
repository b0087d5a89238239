"""Multi-turn black-box agents stay token-consistent behind an engine that samples non-canonical ids.

The scripted engine answers every call with a reply encoded one id per character
(never the tokenizer's own encoding) and records the prompts it received. Agents
on the official openai client send the reply text back as history, as agents do.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.gateway.state.trajectories import RESERVED_STEPS
from trajbus.infra import tiny_model
from trajbus.infra.tiny_model import WEATHER_TOOL
from trajbus.pipelines.processes import free_port
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.records import CONTINUES, SEGMENT_START, Step
from tests.helpers import fetch_groups

TOOL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLIES = [TOOL_REPLY, "<think>the tool said sunny</think>It is sunny in Paris.", "<think>polite</think>Bye now."]


def received(record: Path) -> list[list[int]]:
    return [json.loads(line)["prompt_ids"] for line in record.read_text().splitlines()]


def agent(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="agent", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, messages: list[dict], stream: bool, **options) -> dict:
    """One call; the assistant message as an agent puts it back into its history."""
    if not stream:
        message = client.chat.completions.create(model="tiny", messages=messages, **options).choices[0].message
        calls = [c.model_dump() for c in message.tool_calls or []]
        return {"role": "assistant", "content": message.content, **({"tool_calls": calls} if calls else {})}
    content, calls = "", []
    for chunk in client.chat.completions.create(model="tiny", messages=messages, stream=True, **options):
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta.content or "") if delta else ""
        calls += [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                 "arguments": c.function.arguments}}
                  for c in (delta.tool_calls or [])] if delta else []
    return {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}


def weather_episode(client: openai.OpenAI, stream: bool, between=lambda: None) -> None:
    """Tool call, tool result, answer, thanks, goodbye: three turns, sent back as text."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = chat(client, messages, stream, tools=[WEATHER_TOOL])
    assert reply["tool_calls"][0]["function"]["name"] == "get_weather"
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sunny, 21 C"}]
    between()
    messages += [chat(client, messages, stream, tools=[WEATHER_TOOL])]
    messages += [{"role": "user", "content": "Thanks!"}]
    assert chat(client, messages, stream, tools=[WEATHER_TOOL])["content"] == "<think>polite</think>Bye now."


def assert_token_consistent(trajectory: list[Step]) -> None:
    for before, after in zip(trajectory, trajectory[1:]):
        context = before.prompt_ids + before.response_ids
        assert after.prompt_ids[:len(context)] == context, f"step {after.step_index} does not extend"
        assert SEGMENT_START not in after.metadata


def group_of(bootstrap_servers: str, prefix: str, start_worker, uid: str) -> list[Step]:
    start_worker(n_rollouts=2)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        [group] = fetch_groups(consumer, 1, timeout=60)
    assert group.prompt_uid == uid
    return group.steps


@pytest.mark.parametrize("template", ["default", "reasoning"])
def test_turns_extend_exactly_the_sampled_tokens_plain_streamed_out_of_memory_and_through_a_restart(
        bootstrap_servers, prefix, scripted_engine, start_gateway, start_worker, tiny_model_dir, tmp_path, template):
    tokenizer_dir = tiny_model_dir if template == "default" else \
        tiny_model.with_reasoning_template(tiny_model_dir, tmp_path / "reasoning-tokenizer")
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
    engine, record = scripted_engine(REPLIES)
    port, state = free_port(), tmp_path / "gateway-state"
    # One trajectory in memory: reading one drops the other's state from it, so between turns each trajectory is
    # read once from the state directory, its turns replayed (``read``), as after the restart.
    options = ["--tokenizer-path", str(tokenizer_dir), "--prompt-length", "2048", "--response-length", "256",
               "--cached-trajectories", "1"]
    gateway, process = start_gateway([engine], options, port=port, state_dir=state)
    first = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "weather", "n_rollouts": 2}).json()
    second = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "weather", "n_rollouts": 2}).json()

    def read(trajectory: dict) -> None:
        assert httpx.get(f"{trajectory['base_url']}/models").status_code == 200

    def restart() -> None:  # SIGKILL between two turns: the token state is in the gateway's state directory
        process.kill()
        start_gateway([engine], options, port=port, state_dir=state)
        read(second)

    weather_episode(agent(first["base_url"]), stream=False, between=restart)
    weather_episode(agent(second["base_url"]), stream=True, between=lambda: read(first))
    for t in (first, second):
        assert httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 1.0}).status_code == 200
    assert httpx.get(f"{gateway}/statistics").json()["prompts"] == {"first": 1.0, "continued": 4.0}  # since restart

    steps = group_of(bootstrap_servers, prefix, start_worker, "weather")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    by_trajectory = [[s for s in steps if s.trajectory_uid == t["trajectory_uid"]] for t in (first, second)]
    assert received(record) == [s.prompt_ids for trajectory in by_trajectory for s in trajectory]
    # The first went on past the killed gateway's reservation (its indices may have been sent); the second, out
    # of memory between its turns but never killed, has none skipped.
    assert [[s.step_index for s in t] for t in by_trajectory] == [[0, 1 + RESERVED_STEPS, 2 + RESERVED_STEPS],
                                                                  [0, 1, 2]]
    for trajectory in by_trajectory:
        assert_token_consistent(trajectory)
        for step, reply in zip(trajectory, REPLIES):
            canonical = tokenizer.encode(reply, add_special_tokens=False)
            assert step.response_ids[:-1] != canonical and tokenizer.decode(step.response_ids[:-1]) == reply
    rows = VerlBackend(prompt_length=512, response_length=1024, row_mode="trajectory").rows(steps)
    assert len(rows) == 2
    row_of = {row.steps[0].trajectory_uid: row for row in rows}
    for trajectory in by_trajectory:
        row = row_of[trajectory[0].trajectory_uid]
        assert row.prompt == trajectory[0].prompt_ids
        assert [t for t, m in zip(row.response, row.response_mask) if m] == \
            [t for s in trajectory for t in s.response_ids]
        assert row.prompt + row.response == trajectory[-1].prompt_ids + trajectory[-1].response_ids


@pytest.mark.parametrize("multi_turn", ["cumulative", "render"])
def test_an_edited_history_starts_a_new_segment_and_extra_choices_are_rows_of_their_own(
        bootstrap_servers, prefix, scripted_engine, start_gateway, start_worker, multi_turn):
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
    engine, _ = scripted_engine(["It is 7.", "It is 11."])
    gateway, _ = start_gateway([engine], ["--multi-turn", multi_turn])
    t = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "sums", "n_rollouts": 1}).json()
    client = agent(t["base_url"])
    messages = [{"role": "user", "content": "3 + 4?"}]
    reply = chat(client, messages, stream=False)  # step 0: "It is 7."
    edited = messages + [{"role": "assistant", "content": "It is seven."}, {"role": "user", "content": "5 + 6?"}]
    reply = chat(client, edited, stream=False)  # step 1: a new segment
    messages = edited + [reply, {"role": "user", "content": "And 2 + 2?"}]
    response = client.chat.completions.create(model="tiny", messages=messages, n=2)  # steps 2 and 3
    assert [c.message.content for c in response.choices] == ["It is 7.", "It is 11."]
    messages += [{"role": "assistant", "content": "It is 7."}, {"role": "user", "content": "Sure?"}]
    chat(client, messages, stream=False)  # step 4: continues choice 0 (step 2)
    assert httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 0.5}).status_code == 200

    statistics = httpx.get(f"{gateway}/statistics").json()["prompts"]
    metrics = httpx.get(f"{gateway}/metrics").text
    steps = group_of(bootstrap_servers, prefix, start_worker, "sums")
    assert [s.step_index for s in steps] == [0, 1, 2, 3, 4]
    lineage = [{k: s.metadata[k] for k in (SEGMENT_START, CONTINUES) if k in s.metadata} for s in steps]
    rows = VerlBackend(prompt_length=512, response_length=512, row_mode="trajectory").rows(steps)
    if multi_turn == "cumulative":
        assert lineage == [{}, {SEGMENT_START: True}, {}, {SEGMENT_START: True}, {CONTINUES: 2}]
        assert statistics == {"first": 1.0, "new_segment": 1.0, "continued": 2.0}
        assert 'trajbus_gateway_prompts_total{kind="new_segment"} 1.0' in metrics
        assert [[s.step_index for s in row.steps] for row in rows] == [[0], [1, 2, 4], [3]]
    else:  # every turn re-rendered: the engine's non-canonical ids never come back
        assert lineage == [{}, *[{SEGMENT_START: True}] * 4]
        assert statistics == {"first": 1.0, "new_segment": 3.0}
        assert [[s.step_index for s in row.steps] for row in rows] == [[0], [1], [2], [3], [4]]
