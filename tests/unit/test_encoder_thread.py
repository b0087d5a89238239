"""The tokenizer's encodes on a thread of their own: the same prompts, the caller's errors, one thread, closed."""

from __future__ import annotations

import threading

import pytest

from trajbus.gateway.prompts.conversation import PromptBuilder
from trajbus.gateway.prompts.encoder_thread import EncoderThread
from trajbus.gateway.prompts.token_ids import joined
from trajbus.infra import tiny_model


@pytest.fixture
def encoder():
    encoder = EncoderThread()
    yield encoder
    encoder.close()


def test_every_run_is_on_one_thread_apart_from_the_callers(encoder):
    threads = {encoder.run(threading.current_thread) for _ in range(3)}
    elsewhere: list[threading.Thread] = []
    caller = threading.Thread(target=lambda: elsewhere.append(encoder.run(threading.current_thread)))
    caller.start()
    caller.join()
    assert threads == set(elsewhere) and threading.main_thread() not in threads
    assert next(iter(threads)).name.startswith("trajbus-tokenize")


def test_what_the_function_raises_reaches_the_caller(encoder):
    with pytest.raises(ZeroDivisionError):
        encoder.run(lambda: 1 / 0)
    assert encoder.run(lambda a, b: a + b, 2, 3) == 5  # the thread still serves


def test_closed_it_refuses_work_and_its_thread_has_ended():
    encoder = EncoderThread()
    thread = encoder.run(threading.current_thread)
    encoder.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError):
        encoder.run(len, "x")


def test_prompts_built_on_the_thread_are_the_prompts_built_inline(encoder):
    tokenizer = tiny_model.build_tokenizer()
    encoded_on: set[str] = set()

    def recorded(function, *args):
        def encode(*given):
            encoded_on.add(threading.current_thread().name)
            return function(*given)
        return encoder.run(encode, *args)

    on_thread, here = PromptBuilder(tokenizer, run=recorded), PromptBuilder(tokenizer)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    first = on_thread.build(messages, None, None, None)
    assert first == here.build(messages, None, None, None)
    context = joined(first.ids, tokenizer.encode("7", add_special_tokens=False) + [tokenizer.eos_token_id])
    conversation = messages + [{"role": "assistant", "content": "7"}]
    more = conversation + [{"role": "user", "content": "And 5 + 6?"}]
    continued = on_thread.build(more, None, conversation, context)
    assert continued == here.build(more, None, conversation, context)
    assert not continued.new_segment and continued.ids[:len(context)] == context
    assert len(encoded_on) == 1 and next(iter(encoded_on)).startswith("trajbus-tokenize")
