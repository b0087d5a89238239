"""What counts as a whole engine answer (``gateway.engine.pool.whole_answer``), without any HTTP request.

A non-streamed completion is the answer only with ids and log-probs for every choice asked for;
anything else is the engine's fault (502), never an empty or partial reply answered 200.
"""

from __future__ import annotations

import orjson
import pytest

from trajbus.gateway.engine.pool import Backend, BackendError, whole_answer


def choice(index: int, ids: list[int], finish_reason: str | None = "stop") -> dict:
    return {"index": index, "text": "x" * len(ids), "finish_reason": finish_reason,
            "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-0.5] * len(ids)}}


def answer(*choices: dict) -> bytes:
    return orjson.dumps({"object": "text_completion", "choices": list(choices)})


def test_a_completion_with_ids_and_log_probs_is_whole():
    backend = Backend("http://a:1")
    [first, second] = whole_answer(backend, answer(choice(1, [7], "length"), choice(0, [5, 6])), 2)
    assert (first.index, first.token_ids, first.logprobs, first.finish_reason) == (0, [5, 6], [-0.5, -0.5], "stop")
    assert (second.index, second.token_ids, second.finish_reason) == (1, [7], "length")
    assert backend.failures == 0


@pytest.mark.parametrize("raw", [
    answer({"index": 0, "text": "no ids", "finish_reason": "stop", "logprobs": None}),
    answer(choice(0, [5])),  # two choices asked for, one answered
    orjson.dumps({"error": {"message": "overloaded"}}),
    orjson.dumps({"object": "chat.completion", "choices": [{"index": 0, "message": {"content": "hi"}}]}),
    b"<html>bad gateway</html>",
], ids=["no-ids", "a-choice-missing", "error-body", "chat-completion", "not-json"])
def test_anything_else_is_the_engines_fault(raw: bytes):
    backend = Backend("http://a:1")
    with pytest.raises(BackendError) as error:
        whole_answer(backend, raw, 2)
    assert error.value.status == 502 and "http://a:1" in str(error.value)
    assert backend.failures == 1
