"""Agents on Anthropic's SDK train through the gateway: ``POST {base_url}/v1/messages``, token-exact.

The official ``anthropic`` client, given the ``base_url`` that ``/init_trajectory`` hands out, runs a
3-turn tool-using conversation (tool_use, tool_result, answer, thanks, goodbye), plain and streamed,
behind the scripted engine (replies sampled as non-canonical ids). Each turn's prompt extends the
previous prompt + response, the conversation renders as its OpenAI twin would, and each trajectory
reaches the trainer as one row. One gateway and one engine for the file: one test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.infra.tiny_model import WEATHER_TOOL
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.records import SEGMENT_START, Step
from tests.helpers import fetch_groups

TOOL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLIES = [TOOL_REPLY, "It is sunny in Paris.", "Bye now."]
SYSTEM = "You answer questions about the weather."
TOOL = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
        "input_schema": WEATHER_TOOL["function"]["parameters"]}
STREAM_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                 "message_delta", "message_stop"}
"""The raw events of Anthropic's stream (the SDK's stream also yields derived ones: ``text``, ``input_json``)."""


def agent(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="ignored", max_retries=0, timeout=60)


def call(client: anthropic.Anthropic, messages: list[dict], stream: bool, seen: list[list[str]]) -> Any:
    """One call (``seen``: the raw event types of a streamed one); the message as the SDK returns it."""
    options = {"model": "tiny", "max_tokens": 64, "system": SYSTEM, "tools": [TOOL], "messages": messages}
    if not stream:
        return client.messages.create(**options)
    with client.messages.stream(**options) as events:
        seen.append([e.type for e in events if e.type in STREAM_EVENTS])
        return events.get_final_message()


def weather_episode(client: anthropic.Anthropic, stream: bool, seen: list[list[str]]) -> None:
    """Tool use, tool result, answer, thanks, goodbye: the agent sends each reply back as it got it."""
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = call(client, messages, stream, seen)
    assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["tool_use"]
    [use] = reply.content
    assert (use.name, use.input, use.id[:6]) == ("get_weather", {"city": "Paris"}, "toolu_")
    messages += [{"role": "assistant", "content": reply.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "sunny, 21 C"}]}]
    reply = call(client, messages, stream, seen)
    assert reply.stop_reason == "end_turn" and reply.content[0].text == "It is sunny in Paris."
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "Thanks!"}]
    reply = call(client, messages, stream, seen)
    assert (reply.stop_reason, [b.text for b in reply.content]) == ("end_turn", ["Bye now."])
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens == len("Bye now.") + 1  # one id a char, EOS


def openai_twin() -> list[dict]:
    """The same conversation as an OpenAI agent sends it: the prompt it renders to."""
    call_ = {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call_]},
            {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"},
            {"role": "assistant", "content": "It is sunny in Paris."}, {"role": "user", "content": "Thanks!"}]


def received(record: Path) -> list[list[int]]:
    return [json.loads(line)["prompt_ids"] for line in record.read_text().splitlines()]


def assert_streamed_as_anthropic_events(seen: list[list[str]]) -> None:
    end = ["message_delta", "message_stop"]
    assert all(events[0] == "message_start" and events[-2:] == end for events in seen)
    # A tool call: one block, its input as one JSON delta once parsed.
    assert seen[0] == ["message_start", "content_block_start", "content_block_delta", "content_block_stop", *end]
    # Text: deltas as the engine's tokens are read (those read together are one delta; at most one a token, the
    # space waiting for the next as a tool call may follow), then the block's end.
    deltas = seen[2][2:-3]
    assert seen[2][:2] == ["message_start", "content_block_start"] and seen[2][-3:] == ["content_block_stop", *end]
    assert 1 <= len(deltas) <= len("Bye now.") - 1 and set(deltas) == {"content_block_delta"}, seen[2]


def mixed_trajectory(gateway: str) -> str:
    """One trajectory may mix the APIs (the conversation is the same list of messages either way): a tool call
    through OpenAI's, its result through Anthropic's. Its base_url."""
    base_url = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "mixed", "n_rollouts": 1},
                          timeout=30).json()["base_url"]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = openai.OpenAI(base_url=base_url, api_key="agent", max_retries=0).chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": SYSTEM}, question], tools=[WEATHER_TOOL])
    [used] = first.choices[0].message.tool_calls
    reply = agent(base_url).messages.create(model="tiny", max_tokens=64, system=SYSTEM, tools=[TOOL], messages=[
        question,
        {"role": "assistant", "content": [{"type": "tool_use", "id": used.id, "name": used.function.name,
                                           "input": json.loads(used.function.arguments)}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": used.id, "content": "sunny"}]}])
    assert reply.content[0].text == "It is sunny in Paris."
    return base_url


def assert_errors_are_anthropic_shaped(gateway: str, base_url: str) -> None:
    client = agent(base_url)
    with pytest.raises(anthropic.BadRequestError) as refused:  # an image: the model reads text
        client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "invalid_request_error"
    assert "content blocks are objects of type 'text' or 'tool_result'" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="prefilled"):
        client.messages.create(model="tiny", max_tokens=8, messages=[
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    with pytest.raises(anthropic.BadRequestError, match="response length"):  # --response-length 64
        client.messages.create(model="tiny", max_tokens=65, messages=[{"role": "user", "content": "Hi"}])
    missing = httpx.post(f"{gateway}/nobody/none/v1/v1/messages", timeout=30,
                         json={"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error", missing.text
    with pytest.raises(anthropic.BadRequestError) as at_root:  # a client pointed at the gateway's root
        agent(gateway).messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    body = at_root.value.body
    assert at_root.value.status_code == 400 and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == "invalid_request_error", body
    assert "POST /init_trajectory" in body["error"]["message"] and "base_url" in body["error"]["message"], body


def test_a_tool_using_agent_on_anthropics_sdk_is_captured_token_exactly_plain_and_streamed(
        bootstrap_servers, prefix, scripted_engine, start_gateway, start_worker, tiny_model_dir):
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
    engine, record = scripted_engine(REPLIES)
    gateway, _ = start_gateway([engine])
    trajectories = [httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "weather", "n_rollouts": 2},
                               timeout=30).json() for _ in range(2)]
    seen: list[list[str]] = []
    weather_episode(agent(trajectories[0]["base_url"]), stream=False, seen=seen)
    weather_episode(agent(trajectories[1]["base_url"]), stream=True, seen=seen)
    assert_streamed_as_anthropic_events(seen)
    mixed = mixed_trajectory(gateway)
    assert httpx.get(f"{gateway}/statistics").json()["prompts"] == {"first": 3.0, "continued": 5.0}  # no new segment
    assert_errors_are_anthropic_shaped(gateway, mixed)

    for t in trajectories:
        assert httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 1.0}).status_code == 200
    start_worker(n_rollouts=2)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        [group] = fetch_groups(consumer, 1, timeout=60)
    assert group.prompt_uid == "weather"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    by_trajectory = [[s for s in group.steps if s.trajectory_uid == t["trajectory_uid"]] for t in trajectories]
    assert received(record)[:6] == [s.prompt_ids for steps in by_trajectory for s in steps]
    twin = tokenizer.apply_chat_template(openai_twin(), tools=[WEATHER_TOOL], tokenize=False,
                                         add_generation_prompt=True)
    for steps in by_trajectory:
        assert_one_sequence(steps, tokenizer)
        assert tokenizer.decode(steps[-1].prompt_ids) == twin  # rendered as the OpenAI agent's conversation
    rows = VerlBackend(prompt_length=512, response_length=1024, row_mode="trajectory").rows(group.steps)
    assert sorted(len(row.steps) for row in rows) == [3, 3]  # each trajectory one row
    for row in rows:
        last = row.steps[-1]
        assert row.prompt + row.response == last.prompt_ids + last.response_ids


def assert_one_sequence(steps: list[Step], tokenizer: Any) -> None:
    """Three steps, each prompt the previous prompt + its sampled response + the new turns' template."""
    assert [s.step_index for s in steps] == [0, 1, 2]
    for before, after in zip(steps, steps[1:]):
        context = before.prompt_ids + before.response_ids
        assert after.prompt_ids[:len(context)] == context and SEGMENT_START not in after.metadata
    for step, reply in zip(steps, REPLIES):
        assert tokenizer.decode(step.response_ids[:-1]) == reply
        assert step.response_ids[:-1] != tokenizer.encode(reply, add_special_tokens=False)  # sampled, not re-encoded
