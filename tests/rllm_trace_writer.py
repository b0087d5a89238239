"""A process that stores rLLM traces through KafkaTraceStore and exits at once (no close): what it was told
is acknowledged must be read back by the next store (tests/integration/test_rllm_trace_store.py).

Run: ``python -m tests.rllm_trace_writer BOOTSTRAP_SERVERS PREFIX``. Session ``a``: two turns and a call
between them whose engine returned no ids (no training step: kept on the store's own topic); ``b``: one
trace, then deleted; ``c``: one trace, then ended with reward 1.0; ``d``: one trace without ids, then ended.
"""

from __future__ import annotations

import asyncio
import os
import sys

from trajbus.consumers.rllm import KafkaTraceStore


def rllm_trace(trace_id: str, session_id: str, prompt: list[int], completion: list[int], version: int = 1) -> dict:
    """A trace shaped as rLLM's gateway stores it; log-probs float32-exact, as an engine reports them."""
    return {"trace_id": trace_id, "session_id": session_id, "model": "m",
            "messages": [{"role": "user", "content": f"turn of {trace_id}"}], "prompt_token_ids": prompt,
            "response_message": {"role": "assistant", "content": "ok"}, "completion_token_ids": completion,
            "logprobs": [-0.5 - i for i in range(len(completion))], "finish_reason": "stop",
            "weight_version": version, "latency_ms": 3.0, "token_counts": {}, "timestamp": 1764000000.0,
            "metadata": {}, "raw_request": {"model": "m"}, "raw_response": None}


def no_ids_trace(trace_id: str, session_id: str) -> dict:
    """A trace as rLLM's gateway stores a call whose engine returned no token ids (a passthrough call)."""
    return {**rllm_trace(trace_id, session_id, [], []), "logprobs": None, "weight_version": None}


WRITTEN = {
    "a": [rllm_trace("a1", "a", [1, 2, 3], [4, 5]), no_ids_trace("a1x", "a"),
          rllm_trace("a2", "a", [1, 2, 3, 4, 5, 6], [7], version=2)],
    "b": [rllm_trace("b1", "b", [8], [9])],
    "c": [rllm_trace("c1", "c", [10], [11, 12])],
    "d": [no_ids_trace("d1", "d")],
}


async def write(store: KafkaTraceStore) -> None:
    for session_id, traces in WRITTEN.items():
        for trace in traces:
            await store.store_trace(trace["trace_id"], session_id, trace)
    await store.delete_session("b")
    await store.end_session("c", reward=1.0)
    assert await store.end_session("d") == 0  # no step: the worker sees nothing of it


def main(argv: list[str]) -> None:
    servers, prefix = argv
    asyncio.run(write(KafkaTraceStore(servers, prefix=prefix, timeout=20)))
    sys.stdout.flush()
    os._exit(0)  # no close: every call returned once acknowledged, nothing is left to deliver


if __name__ == "__main__":
    main(sys.argv[1:])
