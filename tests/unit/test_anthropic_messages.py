"""Anthropic's Messages API on the gateway, its pure rules: the request as the chat template's conversation,
generated text as content blocks, stop_reason, the stream's last events, errors in Anthropic's shape."""

from __future__ import annotations

import argparse
import json

import orjson
import pytest
from pydantic import ValidationError

from trajbus.gateway.anthropic.answers import _finish, error_body, parse, stop_reason, streamable
from trajbus.gateway.anthropic.messages import conversation, engine_request
from trajbus.gateway.anthropic.schemas import MessagesRequest
from trajbus.gateway.app import create_app
from trajbus.gateway.config import add_gateway_arguments, settings_from_args
from trajbus.gateway.engine.pool import Completion
from trajbus.gateway.errors import GatewayError, unavailable
from trajbus.gateway.prompts.tool_calls import ParsedOutput

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(messages: list[dict], **fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 16, "messages": messages, **fields})


def test_content_blocks_become_the_chat_templates_messages_in_order():
    body = request(system=[{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Use tools."}], messages=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "rain"}],
             "is_error": False, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]}])
    call = {"type": "function", "function": {"name": "get_weather"}}
    assert conversation(body) == [
        {"role": "system", "content": "Be brief. Use tools."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {**call, "id": "toolu_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {**call, "id": "toolu_2", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "rain"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {**call, "id": "toolu_3", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""}]
    # An empty answer sent back (content []) is an empty assistant turn; no system, no system message.
    assert conversation(request([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": []},
                                 {"role": "user", "content": "Hi?"}]))[1] == {"role": "assistant", "content": ""}


def test_a_prefilled_assistant_reply_is_refused_naming_the_message():
    with pytest.raises(GatewayError) as refused:
        conversation(request([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]))
    assert refused.value.status == 400 and refused.value.message.startswith("messages.1: the last message is the "
                                                                            "assistant's")


def test_tools_are_functions_in_openais_key_order_and_sampling_reaches_the_engine():
    body = request([{"role": "user", "content": "Hi"}], tools=[
        WEATHER, {"type": "computer_20250124", "name": "computer", "display_width_px": 1024,
                  "cache_control": {"type": "ephemeral"}}],
        stop_sequences=["END"], top_k=5, temperature=0.5, stream=True)
    engine = engine_request(body, conversation(body))
    assert [list(tool["function"]) for tool in engine.tools] == [["name", "description", "parameters"]] * 2
    assert engine.tools[0]["function"]["parameters"] == WEATHER["input_schema"]
    assert engine.tools[1]["function"] == {"name": "computer", "parameters": {"type": "object"},
                                           "description": "Anthropic's computer_20250124 tool "
                                                          '{"display_width_px": 1024}'}
    params = engine.engine_params(response_length=64)
    assert (params["max_tokens"], params["stop"], params["top_k"], params["temperature"], params["n"]) == \
        (16, ["END"], 5, 0.5, 1)
    plain = request([{"role": "user", "content": "Hi"}])
    assert engine.stream and "top_k" not in engine_request(plain, conversation(plain)).engine_params(64)


@pytest.mark.parametrize("messages, where, says", [
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages.0.user.content.0",
     "'text' or 'tool_result' (no images"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
     "messages.0.user.content.0", "'text' or 'tool_result'"),
    ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}],
     "messages.0.assistant.content.0", "'text' or 'tool_use'"),
    ([{"role": "system", "content": "Be brief."}], "messages.0", "top-level 'system' field"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}], "messages.1.assistant.content.0.tool_use.input",
     "valid dictionary"),
])
def test_the_schema_refuses_what_the_model_cannot_read_naming_the_block(messages, where, says):
    with pytest.raises(ValidationError) as refused:
        request(messages)
    first = refused.value.errors()[0]
    assert ".".join(str(part) for part in first["loc"]) == where and says in first["msg"]
    with pytest.raises(ValidationError, match="a custom tool needs input_schema"):
        request([{"role": "user", "content": "Hi"}], tools=[{"name": "f"}])


def test_generated_tool_calls_are_tool_use_blocks_and_malformed_ones_stay_text():
    text = 'Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = parse(text, tools=True)
    [call] = parsed.tool_calls
    assert parsed.content == "Let me look." and call["id"].startswith("toolu_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert parse(text, tools=False) == ParsedOutput(text, [])  # no tools offered: all text
    for arguments in ('"Paris"', "[1]", '"{not json"'):  # input must be a JSON object
        malformed = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
        assert parse(malformed, tools=True) == ParsedOutput(malformed, [])
    assert parse("\n<tool_call>" + text.split("<tool_call>")[1], tools=True).content is None


def test_streamed_text_stops_short_of_a_possible_tool_call_and_the_white_space_before_it():
    assert streamable("Sunny in Paris ", tools=False) == len("Sunny in Paris ")
    assert streamable("Sunny in Paris \n", tools=True) == len("Sunny in Paris")
    assert streamable("Let me look.\n<tool_", tools=True) == len("Let me look.")
    assert streamable("  ", tools=True) == 0


def test_the_last_events_close_the_text_and_give_each_tool_call_as_one_json_delta():
    parsed = parse('Looking.\n<tool_call>\n{"name": "f", "arguments": {"q": 1}}\n</tool_call>', tools=True)
    events = [(e.split(b"\n")[0].decode().removeprefix("event: "), orjson.loads(e.split(b"data: ")[1]))
              for e in _finish(parsed, sent=4)]
    assert [name for name, _ in events] == ["content_block_delta", "content_block_stop", "content_block_start",
                                            "content_block_delta", "content_block_stop"]
    assert events[0][1]["delta"] == {"type": "text_delta", "text": "ing."}  # "Look" was streamed
    assert events[2][1] == {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": parsed.tool_calls[0]["id"], "name": "f", "input": {}}}
    assert events[3][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"q": 1}'}
    assert all(name == data["type"] for name, data in events)


def test_stop_reason_names_why_the_engine_stopped():
    eos = 9

    def done(ids: list[int], finish: str = "stop") -> Completion:
        return Completion(0, ids, [0.0] * len(ids), "", finish)

    def decode(ids: list[int]) -> str:
        return "".join({1: "a", 2: "END", 3: "STOP", 9: ""}[i] for i in ids)

    text, calls = ParsedOutput("a", []), parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>', True)
    assert stop_reason(done([1, eos]), calls, None, {eos}, decode) == ("tool_use", None)
    assert stop_reason(done([1, 1], "length"), text, ["END"], {eos}, decode) == ("max_tokens", None)
    assert stop_reason(done([1, 3, 2]), text, ["END", "STOP"], {eos}, decode) == ("stop_sequence", "STOP")
    assert stop_reason(done([1, eos]), text, ["END"], {eos}, decode) == ("end_turn", None)
    assert stop_reason(done([1, eos]), text, None, {eos}, decode) == ("end_turn", None)


def test_errors_are_anthropics_by_status():
    assert error_body(GatewayError(400, "bad")) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                               "message": "bad"}}
    kinds = {status: error_body(GatewayError(status, "x"))["error"]["type"]
             for status in (401, 404, 409, 413, 429, 500, 502)}
    assert kinds == {401: "authentication_error", 404: "not_found_error", 409: "invalid_request_error",
                     413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 502: "api_error"}
    assert error_body(unavailable("not ready"))["error"]["type"] == "overloaded_error"


def test_the_route_is_in_the_gateways_schema_with_its_limits(tmp_path):
    """Where Anthropic's SDK calls it (``{base_url}/v1/messages``), ``max_tokens`` bounded by --response-length."""
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    args = parser.parse_args(["--vllm-addresses", "127.0.0.1:1", "--tokenizer-path", "unused",
                              "--state-dir", str(tmp_path), "--response-length", "64"])
    schema = create_app(settings_from_args(args)).openapi()
    operation = schema["paths"]["/{trajectory_uid}/{prompt_uid}/v1/v1/messages"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/MessagesRequest"}
    assert "security" not in operation  # a base_url is its own capability
    assert schema["components"]["schemas"]["MessagesRequest"]["properties"]["max_tokens"]["maximum"] == 64
