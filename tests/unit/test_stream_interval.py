"""Streamed in pieces of several tokens (vLLM's and SGLang's ``stream_interval``), an answer is the same answer.

The gateway asks an engine stream that no client reads as it comes for ``--engine-stream-interval`` tokens an
event (an event costs far more than a token, at the gateway and at the engine). The project's engine honours
the field as vLLM does: the first event at once, then one each ``stream_interval`` tokens, the last with the
rest and its ``finish_reason``; the tokens, log-probs and text are those of a stream of one token an event.
"""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from trajbus.gateway.engine.pool import request_body
from trajbus.infra import tiny_model
from trajbus.infra.engine_requests import TokenBatches
from trajbus.infra.inference_server import create_app
from trajbus.infra.scripted_engine import ScriptedEngine

REPLY = "Checked the file; the fix is to decode first. Next I run the tests."


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    tiny_model.build_tokenizer().save_pretrained(path)
    engine = ScriptedEngine(path, [REPLY])
    yield engine
    engine.executor.shutdown()


def stream(engine: ScriptedEngine, **fields) -> tuple[int, list[dict]]:
    """POST a streamed completion to the engine's app; the status and the chunks of its events."""
    body = {"prompt": [5, 6, 7], "max_tokens": 500, "logprobs": 0, "return_tokens_as_token_ids": True,
            "stream": True, **fields}

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(engine, "tiny"))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await client.post("/v1/completions", json=body)

    response = asyncio.run(post())
    events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    return response.status_code, [orjson.loads(e) for e in events if e != "[DONE]"]


def joined(chunks: list[dict]) -> tuple[list[str], list[float], str, list[str | None]]:
    choices = [c["choices"][0] for c in chunks]
    return ([t for c in choices for t in c["logprobs"]["tokens"]],
            [v for c in choices for v in c["logprobs"]["token_logprobs"]],
            "".join(c["text"] for c in choices), [c["finish_reason"] for c in choices])


def test_an_interval_groups_the_tokens_and_keeps_the_answer(engine):
    status, single = stream(engine)
    assert status == 200
    tokens, logprobs, text, _ = joined(single)
    assert len(tokens) > 40 and text == REPLY
    status, grouped = stream(engine, stream_interval=16)
    assert status == 200
    sizes = [len(c["choices"][0]["logprobs"]["tokens"]) for c in grouped]
    assert sizes[0] == 1 and set(sizes[1:-1]) == {16} and 0 <= sizes[-1] <= 16
    assert sum(sizes) == len(tokens) and len(grouped) < len(single) / 8
    grouped_tokens, grouped_logprobs, grouped_text, finishes = joined(grouped)
    assert (grouped_tokens, grouped_logprobs, grouped_text) == (tokens, logprobs, text)
    assert finishes[:-1] == [None] * (len(grouped) - 1) and finishes[-1] == "stop"


@pytest.mark.parametrize("interval", [0, -2, 1.5, "16"])
def test_an_interval_that_is_no_positive_integer_is_refused(engine, interval):
    status, _ = stream(engine, stream_interval=interval)
    assert status == 400


def test_the_gateway_asks_for_an_interval_only_of_a_stream():
    sampling = {"max_tokens": 8, "temperature": None}
    assert request_body([1, 2], sampling, None, True, 16)["stream_interval"] == 16
    assert "stream_interval" not in request_body([1, 2], sampling, None, True, 1)
    assert "stream_interval" not in request_body([1, 2], sampling, None, False, 16)


def test_the_engine_wakes_its_server_once_an_interval_not_once_a_token():
    handed: list[tuple[int, list[tuple[int, float]], str]] = []
    batches = TokenBatches(4, handed.append)
    for k in range(10):
        batches.add(0, 100 + k, -0.5 * k, "x" * (k + 1))
    batches.add(1, 7, -1.0, "y")
    assert [(index, len(tokens), text) for index, tokens, text in handed] == \
        [(0, 1, "x"), (0, 4, "x" * 5), (0, 4, "x" * 9), (1, 1, "y")]
    assert batches.rest() == [(0, [(109, -4.5)], "x" * 10)] and batches.rest() == []
    assert [token for index, tokens, _ in handed if index == 0 for token, _ in tokens] == list(range(100, 109))
