"""The gateway's own cost on growing multi-turn conversations, against calling the engine directly.

The engine is ``infra.scripted_engine``: it answers instantly with fixed ids (a
300-token reply, one id per character), so the figures are the gateway's cost, not a model's. At 1, 32
and 256 concurrent agents every agent runs a 10-turn conversation: each turn
adds a ~500-token user message and the reply, so the last prompt is ~8k tokens.
Baseline: the same prompts, as token ids, straight to the engine's
``/v1/completions``. Through the gateway: the agent's messages to its black-box
``base_url`` (prompt built from the conversation's token state, engine call,
Step acknowledged by Kafka, state committed). Reports latency p50/p99,
requests/s and the added latency, per concurrency level and per turn number
(the cost of a call must not grow with the conversation), the latter also for a
gateway with ``--multi-turn render``, which re-renders the conversation at every call.

Uses TRAJBUS_BOOTSTRAP_SERVERS when set, else a throw-away embedded broker.
Prints two tables and writes benchmarks/results/gateway.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Awaitable, Callable

import httpx

from benchmarks.assembly_bench import RESULTS, percentile
from trajbus.gateway.backends import KEEPALIVE_SECONDS, request_body
from trajbus.infra import tiny_model
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.pipelines.processes import ServiceProcess, free_port, gateway_process, scripted_engine_process, wait_http
from trajbus.pipelines.tables import print_table

TURNS = 10
REPLY = ("Checked the file; the failing assertion compares the parsed header against the raw bytes, so "
         "the fix is to decode first. Next I will run the tests again and read the output. " * 2)[:300]
OBSERVATION = "$ pytest -q tests/test_parser.py\n" + "F.. assertion failed: header mismatch at offset 42\n" * 14
LEVELS = (1, 32, 256)


def conversation() -> list[list[dict]]:
    """The messages each turn sends (each reply being what the scripted engine answers)."""
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent."}]
    turns = []
    for turn in range(TURNS):
        messages = messages + [{"role": "user", "content": f"Turn {turn}.\n{OBSERVATION}"}]
        turns.append(messages)
        messages = messages + [{"role": "assistant", "content": REPLY}]
    return turns


def engine_prompts(model_dir: Path, turns: list[list[dict]]) -> list[list[int]]:
    """The prompt ids the gateway sends the engine at each turn (for the direct baseline)."""
    from transformers import AutoTokenizer

    from trajbus.gateway.conversation import PromptBuilder
    from trajbus.infra.scripted_engine import noncanonical_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    builder, reply = PromptBuilder(tokenizer), noncanonical_ids(tokenizer, REPLY) + [tokenizer.eos_token_id]
    prompts, said, context = [], None, None
    for messages in turns:
        prompts.append(builder.build(messages, None, said, context).ids)
        said, context = messages + [{"role": "assistant", "content": REPLY}], prompts[-1] + reply
    return prompts


Call = Callable[[httpx.AsyncClient, int, int], Awaitable[httpx.Response]]


async def run(client: httpx.AsyncClient, agents: int, rounds: int, call: Call) -> tuple[dict[int, list[float]], float]:
    """``agents`` at once, each running ``rounds`` conversations in turn; per-turn latencies, wall time."""
    by_turn: dict[int, list[float]] = {turn: [] for turn in range(TURNS)}

    async def agent(index: int) -> None:
        for conversation_index in range(index * rounds, (index + 1) * rounds):
            for turn in range(TURNS):
                started = time.perf_counter()
                response = await call(client, conversation_index, turn)
                response.raise_for_status()
                by_turn[turn].append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(agent(i) for i in range(agents)))
    return by_turn, time.perf_counter() - started


async def level(client: httpx.AsyncClient, engine: str, gateway: str, agents: int, rounds: int,
                turns: list[list[dict]], prompts: list[list[int]]) -> tuple[dict, list[dict]]:
    """One concurrency level: a row for the table, and the per-turn medians."""
    urls = [(await client.post(f"{gateway}/init_trajectory", json={})).json()["base_url"]
            for _ in range(agents * rounds)]

    def direct(c: httpx.AsyncClient, _conversation: int, turn: int) -> Awaitable[httpx.Response]:
        return c.post(f"http://{engine}/v1/completions",  # the request the gateway makes
                      json=request_body(prompts[turn], {"max_tokens": 512}, None, stream=False))

    def via(c: httpx.AsyncClient, conversation: int, turn: int) -> Awaitable[httpx.Response]:
        return c.post(f"{urls[conversation]}/chat/completions",
                      json={"model": "bench", "messages": turns[turn], "max_tokens": 512})

    direct_turns, direct_s = await run(client, agents, rounds, direct)
    via_turns, via_s = await run(client, agents, rounds, via)
    d = [x for xs in direct_turns.values() for x in xs]
    g = [x for xs in via_turns.values() for x in xs]
    row = {"agents": agents, "requests": len(g),
           "direct_p50_ms": 1000 * statistics.median(d), "direct_p99_ms": 1000 * percentile(d, 0.99),
           "gateway_p50_ms": 1000 * statistics.median(g), "gateway_p99_ms": 1000 * percentile(g, 0.99),
           "direct_rps": len(d) / direct_s, "gateway_rps": len(g) / via_s}
    row["added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
    row["added_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
    row["throughput_ratio"] = row["gateway_rps"] / row["direct_rps"]
    per_turn = [{"turn": t + 1, "prompt_tokens": len(prompts[t]),
                 "direct_p50_ms": 1000 * statistics.median(direct_turns[t]),
                 "gateway_p50_ms": 1000 * statistics.median(via_turns[t])} for t in range(TURNS)]
    for entry in per_turn:
        entry["added_p50_ms"] = entry["gateway_p50_ms"] - entry["direct_p50_ms"]
    print(f"  {agents} agents done: direct {row['direct_rps']:.0f} req/s, gateway {row['gateway_rps']:.0f} req/s",
          flush=True)
    return row, per_turn


async def measure(engine: str, gateway: str, rendering: str, turns: list[list[dict]],
                  prompts: list[list[int]]) -> dict:
    """Every level through the gateway; then one agent through a gateway that re-renders every call
    (``--multi-turn render``), to show what cumulative prompts save per turn."""
    limits = httpx.Limits(max_connections=600, max_keepalive_connections=600, keepalive_expiry=KEEPALIVE_SECONDS)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        for url in (gateway, rendering):
            await level(client, engine, url, 1, 2, turns, prompts)  # warm-up, not reported
        _, rendered = await level(client, engine, rendering, 1, 10, turns, prompts)
        rows, per_turn = [], []
        for agents in LEVELS:
            row, turn_rows = await level(client, engine, gateway, agents, 10 if agents == 1 else 1, turns, prompts)
            rows.append(row)
            per_turn = per_turn or turn_rows  # per turn: the single agent, undisturbed
    for entry, other in zip(per_turn, rendered):
        entry["render_added_p50_ms"] = other["added_p50_ms"]
    return {"levels": rows, "per_turn": per_turn}


def print_tables(result: dict) -> None:
    print_table(["agents", "requests", "direct p50", "direct p99", "direct req/s", "gateway p50", "gateway p99",
                 "gateway req/s", "added p50", "added p99", "ratio"],
                [[r["agents"], r["requests"], f"{r['direct_p50_ms']:.2f} ms", f"{r['direct_p99_ms']:.0f} ms",
                  f"{r['direct_rps']:.1f}", f"{r['gateway_p50_ms']:.2f} ms", f"{r['gateway_p99_ms']:.0f} ms",
                  f"{r['gateway_rps']:.1f}", f"{r['added_p50_ms']:.2f} ms", f"{r['added_p99_ms']:.0f} ms",
                  f"{r['throughput_ratio']:.2f}x"] for r in result["levels"]])
    print()
    print_table(["turn", "prompt tokens", "direct p50", "gateway p50", "added p50", "added p50, --multi-turn render"],
                [[t["turn"], t["prompt_tokens"], f"{t['direct_p50_ms']:.2f} ms", f"{t['gateway_p50_ms']:.2f} ms",
                  f"{t['added_p50_ms']:.2f} ms", f"{t['render_added_p50_ms']:.2f} ms"] for t in result["per_turn"]],
                title="1 agent, by turn number")


def main() -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-bench-gateway-"))
    broker = None
    bootstrap = os.environ.get("TRAJBUS_BOOTSTRAP_SERVERS")
    processes: list[ServiceProcess] = []
    try:
        if not bootstrap:
            broker = EmbeddedKafka(state_dir=workdir / "broker")
            bootstrap = broker.start().bootstrap_servers
        model = tiny_model.build()
        turns = conversation()
        prompts = engine_prompts(model, turns)
        engine_port, gateway_port, rendering_port = free_port(), free_port(), free_port()
        engine = scripted_engine_process(engine_port, workdir, model, [REPLY]).start()
        processes.append(engine)
        for port, mode in ((gateway_port, "cumulative"), (rendering_port, "render")):
            gateway = gateway_process(bootstrap, f"bench-{uuid.uuid4().hex[:6]}", [f"127.0.0.1:{engine_port}"],
                                      model, port, workdir / f"gateway-state-{mode}", workdir / f"gateway-{mode}.log",
                                      ["--prompt-length", "16384", "--response-length", "512",
                                       "--multi-turn", mode]).start()
            processes.append(gateway)
            wait_http(f"http://127.0.0.1:{port}/ready", 120, gateway)
        wait_http(f"http://127.0.0.1:{engine_port}/health", 120, engine)
        print(f"\ngateway: {TURNS}-turn conversations growing to {len(prompts[-1])} prompt tokens, "
              f"{len(REPLY)}-token replies from an instant engine; direct vs through the gateway")
        result = asyncio.run(measure(f"127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}",
                                     f"http://127.0.0.1:{rendering_port}", turns, prompts))
    finally:
        for process in reversed(processes):
            process.stop()
        if broker is not None:
            broker.stop()
    print_tables(result)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
