"""Cumulative token capture: the next prompt continues the sampled tokens, whatever the template."""

from __future__ import annotations

import copy
from array import array

import pytest

from trajbus.gateway.prompts.conversation import CUMULATIVE, RENDER, PromptBuilder, extends
from trajbus.gateway.prompts.token_ids import joined, sampled_ids
from trajbus.infra import tiny_model
from trajbus.infra.scripted_engine import noncanonical_ids

REPLY = "<think>7 is 3 plus 4</think>The answer is 7."
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_model.build_tokenizer()


@pytest.fixture(scope="module")
def reasoning_tokenizer(tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = tiny_model.REASONING_TEMPLATE
    return tokenizer


def sampled(tokenizer, text: str, eos: bool = True) -> list[int]:
    ids = noncanonical_ids(tokenizer, text)
    assert tokenizer.decode(ids) == text
    return ids + ([tokenizer.eos_token_id] if eos else [])


def first_turn(builder: PromptBuilder, messages: list[dict], reply: str, tools=None, eos: bool = True):
    prompt = builder.build(messages, tools, None, None)
    assert not prompt.new_segment and prompt.ids == builder.render(messages, tools)
    context = joined(prompt.ids, sampled(builder.tokenizer, reply, eos))  # as the gateway keeps it
    return context, messages + [{"role": "assistant", "content": reply}]


@pytest.mark.parametrize("template", ["default", "reasoning"])
def test_next_turn_continues_the_sampled_ids_with_only_the_new_turn(tokenizer, reasoning_tokenizer, template):
    tok = tokenizer if template == "default" else reasoning_tokenizer
    builder = PromptBuilder(tok)
    context, conversation = first_turn(builder, [{"role": "user", "content": "What is 3 + 4?"}], REPLY)
    assert tok.encode(REPLY, add_special_tokens=False) != context[-len(REPLY) - 1:-1], "sampled ids are not canonical"
    messages = conversation + [{"role": "user", "content": "And 5 + 6?"}]
    prompt = builder.build(messages, None, conversation, context)
    assert not prompt.new_segment and prompt.ids[:len(context)] == context
    assert tok.decode(prompt.ids[len(context):]) == "\n<|im_start|>user\nAnd 5 + 6?<|im_end|>\n<|im_start|>assistant\n"
    rendered = builder.render(messages, None)
    assert rendered[:len(context)] != context, "re-rendering would have changed tokens that were sampled"
    if template == "reasoning":
        assert "<think>" not in tok.decode(rendered) and "<think>" in tok.decode(prompt.ids)


def test_a_reply_cut_by_length_gets_the_whole_end_of_turn(tokenizer):
    builder = PromptBuilder(tokenizer)
    context, conversation = first_turn(builder, [{"role": "user", "content": "Hi"}], "Hello th", eos=False)
    prompt = builder.build(conversation + [{"role": "user", "content": "Go on"}], None, conversation, context)
    assert prompt.ids[:len(context)] == context
    assert tokenizer.decode(prompt.ids[len(context):]) == \
        "<|im_end|>\n<|im_start|>user\nGo on<|im_end|>\n<|im_start|>assistant\n"


def test_tool_results_with_tools_present_continue_the_tool_call(tokenizer):
    builder = PromptBuilder(tokenizer)
    tools = [tiny_model.WEATHER_TOOL]
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    user = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = builder.build(user, tools, None, None)
    context = joined(prompt.ids, sampled(tokenizer, reply))
    conversation = user + [{"role": "assistant", "content": None, "tool_calls": [CALL]}]
    echoed = user + [{"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    messages = echoed + [{"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    nxt = builder.build(messages, tools, conversation, context)
    assert not nxt.new_segment and nxt.ids[:len(context)] == context
    assert tokenizer.decode(nxt.ids[len(context):]) == \
        "\n<|im_start|>tool\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("edit", ["changed reply", "truncated", "started over"])
def test_history_that_does_not_extend_is_rendered_whole_as_a_new_segment(tokenizer, edit):
    builder = PromptBuilder(tokenizer)
    context, conversation = first_turn(builder, [{"role": "user", "content": "What is 3 + 4?"}], "It is 7.")
    messages = {"changed reply": [conversation[0], {"role": "assistant", "content": "It is 8."}],
                "truncated": conversation[:1],
                "started over": [{"role": "user", "content": "Hello"}]}[edit]
    messages = messages + [{"role": "user", "content": "Sure?"}]
    prompt = builder.build(messages, None, conversation, context)
    assert prompt.new_segment and prompt.ids == builder.render(messages, None)


def test_render_mode_renders_every_call_and_flags_what_does_not_extend(tokenizer):
    builder = PromptBuilder(tokenizer, RENDER)
    context, conversation = first_turn(builder, [{"role": "user", "content": "What is 3 + 4?"}], REPLY)
    messages = conversation + [{"role": "user", "content": "And 5 + 6?"}]
    prompt = builder.build(messages, None, conversation, context)
    assert prompt.ids == builder.render(messages, None) and prompt.new_segment


def test_extends_compares_content_and_tool_calls_not_their_spelling():
    conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    spaced = {**CALL, "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    assert extends(conversation[:1] + [{"role": "assistant", "content": "", "tool_calls": [spaced]}], conversation)
    other = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}
    assert not extends(conversation[:1] + [{"role": "assistant", "tool_calls": [other]}], conversation)
    assert not extends(conversation[:1], conversation) and not extends(conversation, None)


def test_an_unknown_mode_is_refused(tokenizer):
    with pytest.raises(ValueError, match="multi_turn"):
        PromptBuilder(tokenizer, "sometimes")
    assert PromptBuilder(tokenizer).mode == CUMULATIVE


def test_an_engines_ids_are_packed_for_their_step_unless_one_is_no_token_id():
    assert sampled_ids([0, 7, 2**32 - 1]) == array("I", [0, 7, 2**32 - 1])
    for junk in ([1, -5], [1, 2**32], [1, 2.0], [1, None]):
        assert sampled_ids(junk) is junk  # as it came: the step's check names the bad id
