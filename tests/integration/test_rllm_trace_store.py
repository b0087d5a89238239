"""rLLM's trace store on Kafka (consumers.rllm): rLLM's ``TraceStore`` calls against the real broker, traces that
are no training step kept as rLLM's memory store keeps them, a store rebuilt after its writer's process exited,
and rLLM's own gateway in front of it, as its users start it (an engine call without token ids included)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.helpers import decode_step_events, read_to_end, wait_for
from tests.rllm_trace_writer import WRITTEN, no_ids_trace, rllm_trace
from trajbus.consumers import BatchConsumer
from trajbus.consumers.rllm import KafkaTraceStore
from trajbus.consumers.rllm.kept import KeptTrace, kept_topic, read_kept
from trajbus.pipelines.processes import free_port
from trajbus.streams.wire.ledger import ABANDON
from trajbus.streams.wire.records import END_STEPS, SEGMENT_START, Step, TrajectoryEnd

ROOT = Path(__file__).resolve().parents[2]


def topic_events(servers: str, prefix: str) -> tuple[dict[str, Step], list[TrajectoryEnd]]:
    """The steps topic as trajbus reads it: the steps by rLLM trace id, and the trajectory ends."""
    events = decode_step_events(read_to_end(servers, f"{prefix}.steps.train"))
    steps = [e for e in events if isinstance(e, Step)]
    by_trace = {s.metadata["rllm"]["trace_id"]: s for s in steps}
    assert len(by_trace) == len(steps), "a trace was written twice"
    return by_trace, [e for e in events if isinstance(e, TrajectoryEnd)]


def kept_records(servers: str, prefix: str) -> list[Any]:
    """The store's own topic: the traces that are no step (``KeptTrace``) and its session events (dicts)."""
    return [read_kept(m.value()) for m in read_to_end(servers, kept_topic("train", prefix))]


def ids(traces: list[dict[str, Any]]) -> list[str]:
    return [t["trace_id"] for t in traces]


async def protocol_calls(store: KafkaTraceStore) -> None:
    first, second = rllm_trace("t1", "s", [1, 2, 3], [4, 5]), rllm_trace("t2", "s", [1, 2, 3, 4, 5, 6], [7])
    edited = rllm_trace("t3", "s", [1, 9], [10, 11], version=2)  # the agent rewrote its history
    await store.store_trace("t1", "s", first)
    await store.store_trace("t2", "s", second)
    middle = time.time()
    await store.store_trace("t3", "s", edited)
    await store.store_trace("o1", "other", rllm_trace("o1", "other", [1], [2]))
    assert await store.get_trace("t2") == second and await store.get_trace("nope") is None
    assert await store.get_session_traces("s") == [first, second, edited]
    assert ids(await store.get_session_traces("s", since=middle)) == ["t3"]
    assert ids(await store.get_session_traces("s", limit=2)) == ["t1", "t2"]
    assert [(r["session_id"], r["trace_count"]) for r in await store.list_sessions()] == [("other", 1), ("s", 3)]
    assert [r["session_id"] for r in await store.list_sessions(since=middle)] == ["other", "s"]
    assert [r["session_id"] for r in await store.list_sessions(limit=1)] == ["other"]
    with pytest.raises(ValueError, match="^limit: must be a non-negative integer"):
        await store.get_session_traces("s", limit=-1)  # SQLite would read it as no limit, a list slice as "all but"
    await store.store_trace("t1", "s", first)  # a retry of the same trace: nothing new
    with pytest.raises(ValueError, match="^trace_id: 't1' is stored already"):
        await store.store_trace("t1", "s", {**first, "completion_token_ids": [4, 6]})
    with pytest.raises(ValueError, match="^data: a trace that is no training step"):  # JSON cannot keep NaN
        await store.store_trace("t4", "s", {**rllm_trace("t4", "s", [1], []), "latency_ms": float("nan")})
    await store.flush()
    assert await store.delete_session("s") == 3
    assert await store.get_session_traces("s") == [] and await store.get_trace("t1") is None
    assert [r["session_id"] for r in await store.list_sessions()] == ["other"]
    assert await store.delete_session("s") == 0
    await store.store_trace("t5", "s", rllm_trace("t5", "s", [1], [2]))  # the session id again
    assert ids(await store.get_session_traces("s")) == ["t5"]


def test_rllms_store_calls_on_the_broker_and_what_trajbus_reads(bootstrap_servers: str, prefix: str):
    store = KafkaTraceStore(bootstrap_servers, prefix=prefix, timeout=20)
    try:
        asyncio.run(protocol_calls(store))
    finally:
        asyncio.run(store.close())
    steps, ends = topic_events(bootstrap_servers, prefix)
    assert sorted(steps) == ["o1", "t1", "t2", "t3", "t5"]  # t1 once; the refused t4 never
    t1, t2, t3, t5 = steps["t1"], steps["t2"], steps["t3"], steps["t5"]
    assert (t2.prompt_ids, t2.response_ids, t2.rollout_log_probs, t2.policy_version) == ([1, 2, 3, 4, 5, 6], [7],
                                                                                        [-0.5], 1)
    assert t1.trajectory_uid.startswith("s@") and t1.prompt_uid == t1.trajectory_uid
    assert {t2.trajectory_uid, t3.trajectory_uid} == {t1.trajectory_uid}
    assert [t1.step_index, t2.step_index, t3.step_index] == [0, 1, 2]
    assert SEGMENT_START not in t2.metadata and t3.metadata[SEGMENT_START] is True
    assert t5.trajectory_uid not in (t1.trajectory_uid, steps["o1"].trajectory_uid) and t5.step_index == 0
    assert [(e.trajectory_uid, e.prompt_uid, ABANDON in e.metadata) for e in ends] == [("*", t1.trajectory_uid, True)]


def no_step_traces() -> list[dict[str, Any]]:
    """Session ``mixed``: steps around a passthrough call (no ids) and log-probs of another length than the
    completion (not float32-exact: kept as given); session ``none``: only calls whose engine gave no ids."""
    return [rllm_trace("m1", "mixed", [1, 2, 3], [4, 5]),
            {**rllm_trace("m2", "mixed", [], []), "prompt_token_ids": None, "logprobs": None},
            {**rllm_trace("m3", "mixed", [1, 2, 3, 4, 5, 6], [7, 8]), "logprobs": [-0.1, -0.2, -0.3]},
            no_ids_trace("n1", "none"),
            rllm_trace("m4", "mixed", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10])]


async def as_rllms_memory_store(store: KafkaTraceStore) -> None:
    """Every call of both stores, given the same traces, answers the same."""
    from rllm_model_gateway.store.memory_store import MemoryTraceStore

    memory = MemoryTraceStore()

    async def same(call: str, *args: Any, **kwargs: Any) -> Any:
        ours = await getattr(store, call)(*args, **kwargs)
        theirs = await getattr(memory, call)(*args, **kwargs)
        assert ours == theirs, f"{call}{args}{kwargs}"
        return ours

    async def reads() -> None:
        for trace_id in ("m1", "m2", "m3", "m4", "n1", "n2", "nope"):
            await same("get_trace", trace_id)
        for session_id in ("mixed", "none"):
            await same("get_session_traces", session_id)
            await same("get_session_traces", session_id, limit=2)
        ours, theirs = await store.list_sessions(), await memory.list_sessions()
        assert [(r["session_id"], r["trace_count"]) for r in ours] == \
            [(r["session_id"], r["trace_count"]) for r in theirs]

    for trace in no_step_traces():
        await same("store_trace", trace["trace_id"], trace["session_id"], trace)
    await reads()
    assert await store.end_session("none") == 0  # no step: nothing reaches the worker
    await same("store_trace", "n2", "none", no_ids_trace("n2", "none"))
    await reads()
    await store.store_trace("m2", "mixed", await memory.get_trace("m2"))  # a retry: nothing new
    with pytest.raises(ValueError, match="^trace_id: 'm2' is stored already"):
        await store.store_trace("m2", "mixed", {**no_step_traces()[1], "logprobs": [-1.0]})
    assert await store.get_session_traces("mixed", since=time.time()) == []
    assert store.untrainable == {"prompt_token_ids": 1, "logprobs": 1, "completion_token_ids": 2}
    for session_id in ("mixed", "none"):
        await same("delete_session", session_id)
    await reads()


def test_traces_that_are_no_step_are_kept_as_rllms_memory_store_keeps_them(bootstrap_servers: str, prefix: str):
    store = KafkaTraceStore(bootstrap_servers, prefix=prefix, timeout=20)
    try:
        asyncio.run(as_rllms_memory_store(store))
    finally:
        asyncio.run(store.close())
    steps, ends = topic_events(bootstrap_servers, prefix)
    assert sorted(steps) == ["m1", "m4"]  # the steps topic holds the training steps only
    m1, m4 = steps["m1"], steps["m4"]
    assert (m4.trajectory_uid, m4.step_index, SEGMENT_START in m4.metadata) == (m1.trajectory_uid, 1, False)
    assert [(e.prompt_uid, ABANDON in e.metadata) for e in ends] == [(m1.trajectory_uid, True)]  # mixed's delete
    records = kept_records(bootstrap_servers, prefix)
    kept = {r.trace_id: r for r in records if isinstance(r, KeptTrace)}
    assert sorted(kept) == ["m2", "m3", "n1", "n2"] and kept["m3"].reason.startswith("logprobs: has 3 values")
    assert {kept["m2"].trajectory_uid, kept["m3"].trajectory_uid} == {m1.trajectory_uid}
    assert kept["n2"].trajectory_uid != kept["n1"].trajectory_uid  # none was ended
    events = [(r["rllm"], r["trajectory_uid"]) for r in records if not isinstance(r, KeptTrace)]
    assert events == [("ended", kept["n1"].trajectory_uid), ("deleted", kept["n1"].trajectory_uid),
                      ("deleted", kept["n2"].trajectory_uid)]


async def after_restart(store: KafkaTraceStore) -> None:
    assert await store.get_session_traces("a") == WRITTEN["a"]
    assert await store.get_session_traces("d") == WRITTEN["d"]
    assert await store.get_session_traces("b") == [] and await store.get_trace("b1") is None
    assert [(r["session_id"], r["trace_count"]) for r in await store.list_sessions()] == [("d", 1), ("c", 1),
                                                                                          ("a", 3)]
    await store.store_trace("a3", "a", rllm_trace("a3", "a", [1, 2, 3, 4, 5, 6, 7, 8], [9]))
    await store.store_trace("c2", "c", rllm_trace("c2", "c", [10], [13]))
    await store.store_trace("d2", "d", no_ids_trace("d2", "d"))
    assert ids(await store.get_session_traces("a")) == ["a1", "a1x", "a2", "a3"]
    assert ids(await store.get_session_traces("c")) == ["c1", "c2"]
    assert ids(await store.get_session_traces("d")) == ["d1", "d2"]


def test_a_new_store_reads_back_what_an_exited_process_stored(bootstrap_servers: str, prefix: str):
    writer = subprocess.run([sys.executable, "-m", "tests.rllm_trace_writer", bootstrap_servers, prefix],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert writer.returncode == 0, writer.stderr[-3000:]
    store = KafkaTraceStore(bootstrap_servers, prefix=prefix, timeout=20)
    try:
        asyncio.run(after_restart(store))
    finally:
        asyncio.run(store.close())
    steps, ends = topic_events(bootstrap_servers, prefix)
    assert (steps["a3"].trajectory_uid, steps["a3"].step_index) == (steps["a1"].trajectory_uid, 2)  # continued
    assert SEGMENT_START not in steps["a3"].metadata
    assert steps["c2"].trajectory_uid != steps["c1"].trajectory_uid and steps["c2"].step_index == 0  # c was ended
    ended = [e for e in ends if ABANDON not in e.metadata]
    assert [(e.trajectory_uid, e.reward, e.metadata[END_STEPS]) for e in ended] == [(steps["c1"].trajectory_uid,
                                                                                      1.0, [0])]
    kept = {r.trace_id: r for r in kept_records(bootstrap_servers, prefix) if isinstance(r, KeptTrace)}
    assert kept["a1x"].trajectory_uid == steps["a1"].trajectory_uid and "a1x" not in steps
    assert kept["d2"].trajectory_uid != kept["d1"].trajectory_uid  # d was ended, before the restart


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a thread; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 15, "uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def fake_vllm(replies: list[tuple[list[int], list[int]] | None]) -> Any:
    """An engine answering chat completions as vLLM does for rLLM's gateway: token ids and log-probs included;
    a reply None answers as an engine that returns no ids (an OpenAI-compatible server that is no vLLM)."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict) -> dict:
        reply = replies.pop(0)
        if reply is None:
            return {"id": "chatcmpl-2", "object": "chat.completion", "created": 0, "model": body.get("model", "m"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        prompt, completion = reply
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body.get("model", "m"),
                "prompt_token_ids": prompt,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                             "token_ids": completion,
                             "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.25, "bytes": None,
                                                       "top_logprobs": []} for t in completion]}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}}
    return app


def test_rllms_gateway_keeps_its_traces_on_trajbus(bootstrap_servers: str, prefix: str, start_worker):
    """An unchanged OpenAI agent -> rLLM's gateway (create_app(store=...)) -> the traces on Kafka: rLLM's trainer
    reads them from the gateway, trajbus's worker assembles the ended session for a BatchConsumer. The session's
    middle call got no token ids from its engine: the gateway answers it, serves its trace, and the trainer's
    group is the session's two steps."""
    import httpx
    import openai
    from rllm_model_gateway import GatewayConfig, WorkerConfig, create_app

    start_worker()
    store = KafkaTraceStore(bootstrap_servers, prefix=prefix, timeout=20)
    engine = fake_vllm([([1, 2, 3], [4, 5]), None, ([1, 2, 3, 4, 5, 6], [7, 8])])
    with serving(engine) as engine_url:
        with serving(create_app(GatewayConfig(workers=[WorkerConfig(url=f"{engine_url}/v1")], sync_traces=True),
                                    store=store)) as url:
            agent = openai.OpenAI(base_url=f"{url}/sessions/task-3:0/v1", api_key="unused")
            for turn in ("hi", "no ids", "again"):
                answer = agent.chat.completions.create(model="m", messages=[{"role": "user", "content": turn}])
                assert answer.choices[0].message.content == "ok"
            traces = wait_for(lambda: gateway_traces(f"{url}/sessions/task-3:0/traces", 3), 15, "the three traces")
            assert [(t["prompt_token_ids"], t["completion_token_ids"], t["logprobs"]) for t in traces] == [
                ([1, 2, 3], [4, 5], [-0.25, -0.25]), ([], [], None), ([1, 2, 3, 4, 5, 6], [7, 8], [-0.25, -0.25])]
            assert httpx.get(f"{url}/traces/{traces[1]['trace_id']}", timeout=5).json() == traces[1]
            assert store.untrainable == {"completion_token_ids": 1}
            assert asyncio.run(store.end_session("task-3:0", reward=1.0)) == 2
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        steps = consumer.fetch_batch(timeout=30)
    assert steps is not None, "no group from the worker"
    assert [(s.prompt_ids, s.response_ids, s.rollout_log_probs) for s in steps] == [
        ([1, 2, 3], [4, 5], [-0.25, -0.25]), ([1, 2, 3, 4, 5, 6], [7, 8], [-0.25, -0.25])]
    assert steps[-1].reward == 1.0 and {s.metadata["rllm"]["session_id"] for s in steps} == {"task-3:0"}


def gateway_traces(url: str, count: int) -> list[dict[str, Any]] | None:
    """What rLLM's trainer reads from its gateway, once it holds ``count`` traces."""
    import httpx

    traces = httpx.get(url, timeout=5).json()
    return traces if len(traces) == count else None
