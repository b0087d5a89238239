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

CPU per call (``benchmarks.cpu_meter``): the gateway's, the engine's, the broker's and the
benchmark client's own CPU seconds (kernel accounting, not wall time) over each measured
phase, divided by its calls; per concurrency level, and per turn from a phase of one agent
that sends every open conversation's turn n, then turn n + 1 (so each turn is its own phase).
Beside the added latency: the acknowledged produce of one whole 8k-token step, measured in
the same run. Then the 32 and 256 agent levels through two instances (`trajbus gateway --instances 2`),
and the price of cut-and-continue: 1 agent and 32 agents through the gateway and through one that
reads a non-streaming agent's answer as one JSON answer (``--engine-streaming when-asked``), three
phases each, alternating, medians compared, before the levels (so both gateways have served the same
calls). Each level runs through the gateway and the same level through the libraries' floor
(``benchmarks.library_floor``: the same calls through the same libraries with no trajbus code), the least a
call can cost on this machine, three phases each, alternating, and each reports its median phase. Last, the
targets
(issues 25, 31 and 47) with the figures of this run and whether each is met.

Uses TRAJBUS_BOOTSTRAP_SERVERS when set, else a throw-away embedded broker.
Prints six tables and writes benchmarks/results/gateway.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp
import orjson

from benchmarks.assembly_bench import RESULTS, percentile
from benchmarks.cpu_meter import CpuMeter
from benchmarks.gateway_report import gateway_cpu, print_tables, targets
from benchmarks.gateway_workload import (FLEET_INSTANCES, FLEET_LEVELS, LEVELS, REPLY, TURN_CONVERSATIONS,
                                         TURN_SWEEPS, TURNS, conversation, engine_prompts)
from benchmarks.library_floor import floor_process
from benchmarks.targets import print_targets
from trajbus.gateway.engine.pool import KEEPALIVE_SECONDS, request_body
from trajbus.infra import tiny_model
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.local import free_ports
from trajbus.pipelines.processes import ServiceProcess, free_port, gateway_process, scripted_engine_process, wait_http
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.records import Step

STREAM_COST_LEVELS = {1: 10, 32: 1}
"""Agents: rounds of their conversations per phase, in the cut-and-continue / when-asked comparison (one
agent: each call's engine events are read one by one, none batched with another call's; 100 calls a
phase, an average over many calls)."""
STREAM_COST_PHASES = 3
"""Phases of each gateway, alternating, in the cut-and-continue / when-asked comparison (median of each)."""
LEVEL_PHASES = 3
"""Phases of the gateway and of the libraries' floor at each level, alternating; each reports its median phase
(by its CPU per call): one phase's ratio to the floor moved by 0.3x between runs of the same code."""
JSON_HEADERS = {"Content-Type": "application/json"}
PRODUCE_SAMPLES = 100
Call = Callable[[aiohttp.ClientSession, int, int], Awaitable[bytes]]


async def post(client: aiohttp.ClientSession, url: str, body: bytes) -> bytes:
    """One call; its answer read whole. Bodies are encoded once, so the client's own cost stays small."""
    async with client.post(url, data=body, headers=JSON_HEADERS) as response:
        answer = await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {answer[:300]!r}")
        return answer


def calls(engine: str, urls: list[str], turns: list[list[dict]], prompts: list[list[int]]) -> tuple[Call, Call]:
    """The direct call (the request the gateway makes the engine) and the agent's call through the gateway."""
    direct_bodies = [orjson.dumps(request_body(p, {"max_tokens": 512}, None, stream=False)) for p in prompts]
    via_bodies = [orjson.dumps({"model": "bench", "messages": t, "max_tokens": 512}) for t in turns]

    def direct(c: aiohttp.ClientSession, _conversation: int, turn: int) -> Awaitable[bytes]:
        return post(c, f"http://{engine}/v1/completions", direct_bodies[turn])

    def via(c: aiohttp.ClientSession, conversation: int, turn: int) -> Awaitable[bytes]:
        return post(c, f"{urls[conversation]}/chat/completions", via_bodies[turn])

    return direct, via


async def open_trajectories(client: aiohttp.ClientSession, gateways: list[str], count: int) -> list[str]:
    """``count`` new trajectories' black-box base URLs, opened round robin at the gateways given (before a
    phase, so not measured)."""
    return [orjson.loads(await post(client, f"{gateways[i % len(gateways)]}/init_trajectory",
                                    orjson.dumps({"prompt_uid": uuid.uuid4().hex, "n_rollouts": 1})))["base_url"]
            for i in range(count)]


async def run(client: aiohttp.ClientSession, agents: int, rounds: int, call: Call
              ) -> tuple[dict[int, list[float]], float]:
    """``agents`` at once, each running ``rounds`` conversations in turn; per-turn latencies, wall time."""
    by_turn: dict[int, list[float]] = {turn: [] for turn in range(TURNS)}

    async def agent(index: int) -> None:
        for conversation_index in range(index * rounds, (index + 1) * rounds):
            for turn in range(TURNS):
                started = time.perf_counter()
                await call(client, conversation_index, turn)
                by_turn[turn].append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(agent(i) for i in range(agents)))
    return by_turn, time.perf_counter() - started


async def level(client: aiohttp.ClientSession, engine: str, gateways: list[str], agents: int, rounds: int,
                turns: list[list[dict]], prompts: list[list[int]], meter: CpuMeter) -> tuple[dict, list[dict]]:
    """One concurrency level: a row for the table (with each process's CPU per call on either path),
    and the per-turn medians."""
    direct, via = calls(engine, await open_trajectories(client, gateways, agents * rounds), turns, prompts)
    before = meter.snapshot()
    direct_turns, direct_s = await run(client, agents, rounds, direct)
    direct_cpu = meter.since(before)
    before = meter.snapshot()
    via_turns, via_s = await run(client, agents, rounds, via)
    via_cpu = meter.since(before)
    d = [x for xs in direct_turns.values() for x in xs]
    g = [x for xs in via_turns.values() for x in xs]
    row = {"agents": agents, "requests": len(g),
           "direct_p50_ms": 1000 * statistics.median(d), "direct_p99_ms": 1000 * percentile(d, 0.99),
           "gateway_p50_ms": 1000 * statistics.median(g), "gateway_p99_ms": 1000 * percentile(g, 0.99),
           "direct_rps": len(d) / direct_s, "gateway_rps": len(g) / via_s,
           "cpu": {"direct": direct_cpu.summary(len(d)), "gateway": via_cpu.summary(len(g))}}
    row["added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
    row["added_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
    row["throughput_ratio"] = row["gateway_rps"] / row["direct_rps"]
    per_turn = [{"turn": t + 1, "prompt_tokens": len(prompts[t]),
                 "direct_p50_ms": 1000 * statistics.median(direct_turns[t]),
                 "gateway_p50_ms": 1000 * statistics.median(via_turns[t])} for t in range(TURNS)]
    for entry in per_turn:
        entry["added_p50_ms"] = entry["gateway_p50_ms"] - entry["direct_p50_ms"]
    gateway_ms = row["cpu"]["gateway"]["cpu_ms_per_call"]["gateway"]
    print(f"  {agents} agents, {len(gateways)} gateway(s) done: direct {row['direct_rps']:.0f} req/s, "
          f"gateway {row['gateway_rps']:.0f} req/s, gateway CPU {gateway_ms:.1f} ms/call", flush=True)
    return row, per_turn


def _median_level(phases: list[tuple[dict, list[dict]]]) -> tuple[dict, list[dict]]:
    """Of one level's phases through one path, the one whose gateway CPU per call is the median, with every
    phase's figure beside it (``phases_ms``)."""
    row, turn_rows = sorted(phases, key=lambda phase: gateway_cpu(phase[0]))[len(phases) // 2]
    return {**row, "phases_ms": [gateway_cpu(phase[0]) for phase in phases]}, turn_rows


def _median_phase(phases: list[dict], process: str) -> dict:
    """Of one turn's phases (one per sweep), the one whose ``process`` CPU per call is the median."""
    return sorted(phases, key=lambda phase: phase["cpu_ms_per_call"][process])[len(phases) // 2]


async def turn_costs(client: aiohttp.ClientSession, engine: str, gateway: str, turns: list[list[dict]],
                     prompts: list[list[int]], meter: CpuMeter) -> list[dict]:
    """CPU per call at each turn: one agent sends turn n of every open conversation (one phase, directly
    and through the gateway), then turn n + 1; the conversations are open at once, as at 32 agents. The
    sweep of all turns runs ``TURN_SWEEPS`` times over new conversations, and each turn reports its median
    phase: one sweep's figures moved by more than the 1.15x bound between runs on a quiet machine."""
    phases: list[dict[str, list[dict]]] = [{"direct": [], "gateway": []} for _ in range(TURNS)]
    for _ in range(TURN_SWEEPS):
        direct, via = calls(engine, await open_trajectories(client, [gateway], TURN_CONVERSATIONS), turns, prompts)
        for turn in range(TURNS):
            for path, call in (("direct", direct), ("gateway", via)):
                before = meter.snapshot()
                for index in range(TURN_CONVERSATIONS):
                    await call(client, index, turn)
                phases[turn][path].append(meter.since(before).summary(TURN_CONVERSATIONS))
    costs = [{"turn": turn + 1, "prompt_tokens": len(prompts[turn]),
              "direct": _median_phase(phases[turn]["direct"], "engine"),
              "gateway": _median_phase(phases[turn]["gateway"], "gateway"),
              "gateway_sweeps_ms": [p["cpu_ms_per_call"]["gateway"] for p in phases[turn]["gateway"]]}
             for turn in range(TURNS)]
    turn_10 = costs[-1]["gateway"]["cpu_ms_per_call"]["gateway"]
    print(f"  per-turn CPU done: gateway {turn_10:.1f} ms/call at turn {TURNS} (median of {TURN_SWEEPS} sweeps)",
          flush=True)
    return costs


async def measure(engine: str, gateways: dict[str, list[str]], turns: list[list[dict]], prompts: list[list[int]],
                  meters: dict[str, CpuMeter]) -> dict:
    """Every level through the gateway; then one agent through a gateway that re-renders every call
    (``--multi-turn render``), to show what cumulative prompts save per turn; then the fleet levels
    through two instances (``--instances 2``), trajectories opened at each in turn. Each level alternates with the
    same level through the libraries' floor (``benchmarks.library_floor``), ``LEVEL_PHASES`` of each, and reports
    the median phase of each. Before the levels, the
    price of cut-and-continue against ``--engine-streaming when-asked`` (``compare_streaming``)."""
    connector = aiohttp.TCPConnector(limit=600, keepalive_timeout=KEEPALIVE_SECONDS)
    (gateway,), (rendering,), (when_asked,) = gateways["single"], gateways["render"], gateways["when-asked"]
    meter = meters["single"]
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as client:
        for name, urls in gateways.items():
            await level(client, engine, urls, 1, 2, turns, prompts, meters[name])  # warm-up, not reported
        stream_cost = await compare_streaming(client, engine, gateway, when_asked, turns, prompts, meters)
        _, rendered = await level(client, engine, [rendering], 1, 10, turns, prompts, meters["render"])
        turn_cpu = await turn_costs(client, engine, gateway, turns, prompts, meter)
        rows, per_turn, floor_rows = [], [], []
        for agents in LEVELS:  # each level and the floor's alternating: the machine's pace drifts over minutes
            rounds = 10 if agents == 1 else 1
            phases: dict[str, list[tuple[dict, list[dict]]]] = {"gateway": [], "floor": []}
            for _ in range(LEVEL_PHASES):
                phases["gateway"].append(await level(client, engine, [gateway], agents, rounds, turns, prompts,
                                                     meter))
                phases["floor"].append(await level(client, engine, gateways["floor"], agents, rounds, turns,
                                                   prompts, meters["floor"]))
            (row, turn_rows), (floor_row, _) = (_median_level(phases[path]) for path in ("gateway", "floor"))
            rows.append(row)
            per_turn = per_turn or turn_rows  # per turn: the single agent, undisturbed
            floor_rows.append(floor_row)
        fleet_rows = [(await level(client, engine, gateways["fleet"], agents, 1, turns, prompts, meters["fleet"]))[0]
                      for agents in FLEET_LEVELS]
    for entry, other, cpu in zip(per_turn, rendered, turn_cpu):
        entry["render_added_p50_ms"] = other["added_p50_ms"]
        entry["cpu"] = {"direct": cpu["direct"], "gateway": cpu["gateway"]}
        entry["gateway_sweeps_ms"] = cpu["gateway_sweeps_ms"]
    return {"levels": rows, "per_turn": per_turn, "fleet": fleet_rows, "stream_cost": stream_cost,
            "library_floor": floor_rows}


async def compare_streaming(client: aiohttp.ClientSession, engine: str, gateway: str, when_asked: str,
                            turns: list[list[dict]], prompts: list[list[int]], meters: dict[str, CpuMeter]
                            ) -> list[dict]:
    """The gateway's CPU per call at each of ``STREAM_COST_LEVELS`` streaming every call (cut-and-continue)
    and reading a non-streaming agent's answer as one JSON answer (``when-asked``): phases alternating,
    medians compared."""
    gateways = {"always": (gateway, meters["single"]), "when-asked": (when_asked, meters["when-asked"])}
    results = []
    for agents, rounds in STREAM_COST_LEVELS.items():
        phases: dict[str, list[float]] = {name: [] for name in gateways}
        for _ in range(STREAM_COST_PHASES):
            for name, (url, meter) in gateways.items():
                row, _ = await level(client, engine, [url], agents, rounds, turns, prompts, meter)
                phases[name].append(gateway_cpu(row))
        results.append({"agents": agents, "phases_ms": phases,
                        "median_ms": {name: statistics.median(values) for name, values in phases.items()}})
    return results


def produce_latency(bootstrap: str, prompt: list[int], reply: list[int]) -> dict:
    """Acknowledged produce of one whole step (prompt + reply of the last turn, a new trajectory each so
    no prefix reference), one call at a time: the least a gateway call waits for its Step."""
    latencies = []
    with StepProducer(bootstrap, prefix=f"bench-produce-{uuid.uuid4().hex[:6]}") as producer:
        producer.provision("train")
        for index in range(PRODUCE_SAMPLES + 5):  # the first 5 warm the connection up
            uid = uuid.uuid4().hex
            step = Step(prompt_ids=prompt, response_ids=reply, trajectory_uid=uid, prompt_uid=uid)
            started = time.perf_counter()
            producer.submit_steps([step], channel="train")
            if index >= 5:
                latencies.append(time.perf_counter() - started)
    return {"tokens": len(prompt) + len(reply), "samples": len(latencies),
            "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * percentile(latencies, 0.99)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway_bench", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-bench-gateway-"))
    broker, pids = None, {}
    bootstrap = os.environ.get("TRAJBUS_BOOTSTRAP_SERVERS")
    processes: list[ServiceProcess] = []
    try:
        if not bootstrap:
            broker = EmbeddedKafka(state_dir=workdir / "broker")
            state = broker.start()
            bootstrap, pids["broker"] = state.bootstrap_servers, state.pid
        model = tiny_model.build()
        turns = conversation()
        prompts, reply = engine_prompts(model, turns)
        engine_port, gateway_port, rendering_port, when_asked_port, floor_port = (free_port() for _ in range(5))
        fleet_port = free_ports(FLEET_INSTANCES + 1)
        engine = scripted_engine_process(engine_port, workdir, model, [REPLY]).start()
        processes.append(engine)
        for port, name, flags in ((gateway_port, "single", []),
                                  (rendering_port, "render", ["--multi-turn", "render"]),
                                  (fleet_port, "fleet", ["--instances", str(FLEET_INSTANCES)]),
                                  (when_asked_port, "when-asked", ["--engine-streaming", "when-asked"])):
            processes.append(gateway_process(
                bootstrap, f"bench-{uuid.uuid4().hex[:6]}", [f"127.0.0.1:{engine_port}"], model, port,
                workdir / f"gateway-state-{name}", workdir / f"gateway-{name}.log",
                ["--prompt-length", "16384", "--response-length", "512", *flags]).start())
        (workdir / "prompts.json").write_bytes(orjson.dumps(prompts))
        processes.append(floor_process(floor_port, f"127.0.0.1:{engine_port}", bootstrap, workdir / "prompts.json",
                                       model, workdir / "library-floor.log").start())
        gateways = {name: [f"http://127.0.0.1:{port}"] for name, port in
                    (("single", gateway_port), ("render", rendering_port), ("when-asked", when_asked_port),
                     ("floor", floor_port))}
        gateways["fleet"] = [f"http://127.0.0.1:{fleet_port + 1 + i}" for i in range(FLEET_INSTANCES)]
        for urls in gateways.values():
            for url in urls:
                wait_http(f"{url}/ready", 120)
        wait_http(f"http://127.0.0.1:{engine_port}/health", 120, engine)
        shared = {**pids, "engine": engine.pid}
        meters = {name: CpuMeter({**shared, "gateway": process.pid})  # the fleet's instances: its descendants
                  for name, process in zip(("single", "render", "fleet", "when-asked", "floor"), processes[1:])}
        print(f"\ngateway: {TURNS}-turn conversations growing to {len(prompts[-1])} prompt tokens, "
              f"{len(REPLY)}-token replies from an instant engine; direct vs through the gateway")
        result = asyncio.run(measure(f"127.0.0.1:{engine_port}", gateways, turns, prompts, meters))
        result["produce"] = produce_latency(bootstrap, prompts[-1], reply)
    finally:
        for process in reversed(processes):
            process.stop()
        if broker is not None:
            broker.stop()
    print_tables(result)
    result["targets"] = print_targets(targets(result), "Targets (instant engine, this machine)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
