"""Parsing of <tool_call> blocks into OpenAI tool calls, and the streamable content prefix."""

from __future__ import annotations

import json

import pytest

from trajbus.gateway.prompts.tool_calls import parse, safe_prefix


def block(name, arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_text_without_a_block_is_all_content():
    parsed = parse("The answer is 4.")
    assert (parsed.content, parsed.tool_calls) == ("The answer is 4.", [])


def test_one_call_with_content_before_it():
    parsed = parse("Let me look.\n" + block("search", {"q": "kafka"}))
    assert parsed.content == "Let me look."
    [call] = parsed.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "search", "arguments": '{"q": "kafka"}'}


def test_several_calls_keep_their_order_and_get_distinct_ids():
    parsed = parse(block("a", {"x": 1}) + "\n" + block("b", {}))
    assert parsed.content is None  # nothing before the first block
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a", "b"]
    assert [c["function"]["arguments"] for c in parsed.tool_calls] == ['{"x": 1}', "{}"]
    assert parsed.tool_calls[0]["id"] != parsed.tool_calls[1]["id"]


def test_whitespace_inside_the_block_and_string_arguments():
    parsed = parse('<tool_call>\n  {"name": "f", "arguments": "{\\"k\\": 2}"}\n</tool_call>')
    assert parsed.tool_calls[0]["function"] == {"name": "f", "arguments": '{"k": 2}'}


def test_missing_arguments_become_an_empty_object():
    parsed = parse('<tool_call>{"name": "now"}</tool_call>')
    assert parsed.tool_calls[0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call>",
    block("ok", {}) + "<tool_call>{broken</tool_call>",  # one bad block spoils them all
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>["f"]</tool_call>',
    "<tool_call>{\"name\": \"f\"}",  # never closed
])
def test_malformed_blocks_leave_the_whole_text_as_content(text):
    parsed = parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])


@pytest.mark.parametrize("text, expected", [
    ("hello", 5),
    ("hello <tool_call>{", 6),
    ("hello <tool", 6),  # a possible start is held back
    ("hello <", 6),
    ("a < b", 5),
    ("", 0),
])
def test_safe_prefix(text, expected):
    assert safe_prefix(text) == expected
