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
calls). Last, the targets (issues 25 and 31) with the figures of this run and whether each is met.

Uses TRAJBUS_BOOTSTRAP_SERVERS when set, else a throw-away embedded broker.
Prints five tables and writes benchmarks/results/gateway.json.
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
from benchmarks.targets import Target, print_targets
from trajbus.gateway.backends import KEEPALIVE_SECONDS, request_body
from trajbus.infra import tiny_model
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.local import free_ports
from trajbus.pipelines.processes import ServiceProcess, free_port, gateway_process, scripted_engine_process, wait_http
from trajbus.pipelines.tables import print_table
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.records import Step

TURNS = 10
REPLY = ("Checked the file; the failing assertion compares the parsed header against the raw bytes, so "
         "the fix is to decode first. Next I will run the tests again and read the output. " * 2)[:300]
OBSERVATION = "$ pytest -q tests/test_parser.py\n" + "F.. assertion failed: header mismatch at offset 42\n" * 14
LEVELS = (1, 32, 256)
FLEET_LEVELS = (32, 256)
FLEET_INSTANCES = 2
STREAM_COST_LEVELS = {1: 10, 32: 1}
"""Agents: rounds of their conversations per phase, in the cut-and-continue / when-asked comparison (one
agent: each call's engine events are read one by one, none batched with another call's; 100 calls a
phase, as the kernel counts CPU in 10 ms ticks)."""
STREAM_COST_PHASES = 3
"""Phases of each gateway, alternating, in the cut-and-continue / when-asked comparison (median of each)."""
JSON_HEADERS = {"Content-Type": "application/json"}
TURN_CONVERSATIONS = 100
"""Conversations of the per-turn CPU phase: each turn's phase is this many calls (the kernel counts
CPU in 10 ms ticks, so a per-call figure is exact to 0.1 ms at 100 calls, to 0.25 ms at 40)."""
PRODUCE_SAMPLES = 100


def conversation() -> list[list[dict]]:
    """The messages each turn sends (each reply being what the scripted engine answers)."""
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent."}]
    turns = []
    for turn in range(TURNS):
        messages = messages + [{"role": "user", "content": f"Turn {turn}.\n{OBSERVATION}"}]
        turns.append(messages)
        messages = messages + [{"role": "assistant", "content": REPLY}]
    return turns


def engine_prompts(model_dir: Path, turns: list[list[dict]]) -> tuple[list[list[int]], list[int]]:
    """The prompt ids the gateway sends the engine at each turn (for the direct baseline), and the
    reply's ids."""
    from transformers import AutoTokenizer

    from trajbus.gateway.conversation import PromptBuilder
    from trajbus.infra.scripted_engine import noncanonical_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    builder, reply = PromptBuilder(tokenizer), noncanonical_ids(tokenizer, REPLY) + [tokenizer.eos_token_id]
    prompts, said, context = [], None, None
    for messages in turns:
        prompts.append(builder.build(messages, None, said, context).ids)
        said, context = messages + [{"role": "assistant", "content": REPLY}], prompts[-1] + reply
    return prompts, reply


Call = Callable[[aiohttp.ClientSession, int, int], Awaitable[bytes]]
PROCESSES = ("gateway", "engine", "broker", "client")
"""Whose CPU a phase reports (the broker only when this benchmark started it)."""


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


async def turn_costs(client: aiohttp.ClientSession, engine: str, gateway: str, turns: list[list[dict]],
                     prompts: list[list[int]], meter: CpuMeter) -> list[dict]:
    """CPU per call at each turn: one agent sends turn n of every open conversation (one phase, directly
    and through the gateway), then turn n + 1; the conversations are open at once, as at 32 agents."""
    direct, via = calls(engine, await open_trajectories(client, [gateway], TURN_CONVERSATIONS), turns, prompts)
    costs = []
    for turn in range(TURNS):
        entry = {"turn": turn + 1, "prompt_tokens": len(prompts[turn])}
        for path, call in (("direct", direct), ("gateway", via)):
            before = meter.snapshot()
            for conversation in range(TURN_CONVERSATIONS):
                await call(client, conversation, turn)
            entry[path] = meter.since(before).summary(TURN_CONVERSATIONS)
        costs.append(entry)
    turn_10 = costs[-1]["gateway"]["cpu_ms_per_call"]["gateway"]
    print(f"  per-turn CPU done: gateway {turn_10:.1f} ms/call at turn {TURNS}", flush=True)
    return costs


async def measure(engine: str, gateway: str, rendering: str, fleet: list[str], when_asked: str,
                  turns: list[list[dict]], prompts: list[list[int]], meters: dict[str, CpuMeter]) -> dict:
    """Every level through the gateway; then one agent through a gateway that re-renders every call
    (``--multi-turn render``), to show what cumulative prompts save per turn; then the fleet levels
    through two instances (``--instances 2``), trajectories opened at each in turn. Before the levels,
    the price of cut-and-continue against ``--engine-streaming when-asked`` (``compare_streaming``)."""
    connector = aiohttp.TCPConnector(limit=600, keepalive_timeout=KEEPALIVE_SECONDS)
    meter = meters["single"]
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as client:
        for urls in ([gateway], [rendering], fleet, [when_asked]):
            await level(client, engine, urls, 1, 2, turns, prompts, meter)  # warm-up, not reported
        stream_cost = await compare_streaming(client, engine, gateway, when_asked, turns, prompts, meters)
        _, rendered = await level(client, engine, [rendering], 1, 10, turns, prompts, meter)
        turn_cpu = await turn_costs(client, engine, gateway, turns, prompts, meter)
        rows, per_turn = [], []
        for agents in LEVELS:
            row, turn_rows = await level(client, engine, [gateway], agents, 10 if agents == 1 else 1, turns, prompts,
                                         meter)
            rows.append(row)
            per_turn = per_turn or turn_rows  # per turn: the single agent, undisturbed
        fleet_rows = [(await level(client, engine, fleet, agents, 1, turns, prompts, meters["fleet"]))[0]
                      for agents in FLEET_LEVELS]
    for entry, other, cpu in zip(per_turn, rendered, turn_cpu):
        entry["render_added_p50_ms"] = other["added_p50_ms"]
        entry["cpu"] = {"direct": cpu["direct"], "gateway": cpu["gateway"]}
    return {"levels": rows, "per_turn": per_turn, "fleet": fleet_rows, "stream_cost": stream_cost}


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


def gateway_cpu(row: dict) -> float:
    """The gateway's CPU ms per call of a level's calls through it."""
    return row["cpu"]["gateway"]["cpu_ms_per_call"]["gateway"]


def stream_price(cost: dict) -> tuple:
    """Issue 31's bound on cut-and-continue's price at one level of ``compare_streaming``."""
    streamed, unstreamed = cost["median_ms"]["always"], cost["median_ms"]["when-asked"]
    return (f"cut-and-continue / when-asked, gateway CPU at {cost['agents']} agent(s) (medians)", "<= 1.2x",
            f"{streamed / unstreamed:.3f}x ({streamed:.2f} vs {unstreamed:.2f} ms)", streamed <= 1.2 * unstreamed)


def targets(result: dict) -> list[Target]:
    """Issues 25's and 31's targets, each with the measured figure and whether it is met (compared unrounded)."""
    levels = {row["agents"]: row for row in result["levels"]}
    turn_10 = gateway_cpu(next(t for t in result["per_turn"] if t["turn"] == TURNS))
    produce, added = result["produce"]["p50_ms"], levels[1]["added_p50_ms"]
    rps_32, rps_256 = levels[32]["gateway_rps"], levels[256]["gateway_rps"]
    fleet = {row["agents"]: row for row in result["fleet"]}
    fleet_checks = [(f"{FLEET_INSTANCES} instances / 1 at {agents} agents", "> 1.0x",
                     f"{fleet[agents]['gateway_rps'] / levels[agents]['gateway_rps']:.3f}x "
                     f"({fleet[agents]['gateway_rps']:.1f} vs {levels[agents]['gateway_rps']:.1f} req/s)",
                     fleet[agents]["gateway_rps"] > levels[agents]["gateway_rps"]) for agents in FLEET_LEVELS]
    checks = [
        ("gateway CPU per call at turn 10, 1 agent", "<= 2 ms", f"{turn_10:.2f} ms", turn_10 <= 2.0),
        *((f"gateway CPU per call at {agents} agents (turns 1-10)", "<= 2 ms",
           f"{gateway_cpu(levels[agents]):.2f} ms", gateway_cpu(levels[agents]) <= 2.0) for agents in LEVELS),
        *(stream_price(cost) for cost in result["stream_cost"]),
        ("added p50 at 1 agent", f"<= produce p50 + 2 ms = {produce + 2:.2f} ms", f"{added:.2f} ms",
         added <= produce + 2.0),
        ("throughput at 32 agents / direct", ">= 0.8x", f"{levels[32]['throughput_ratio']:.3f}x",
         levels[32]["throughput_ratio"] >= 0.8),
        ("throughput at 256 agents / direct", ">= 0.8x", f"{levels[256]['throughput_ratio']:.3f}x",
         levels[256]["throughput_ratio"] >= 0.8),
        ("throughput at 256 agents / at 32", ">= 1.0x",
         f"{rps_256 / rps_32:.3f}x ({rps_256:.1f} vs {rps_32:.1f} req/s; "
         f"the engine called directly: {levels[256]['direct_rps'] / levels[32]['direct_rps']:.3f}x)",
         rps_256 >= rps_32),
        *fleet_checks,
    ]
    return [Target(*check) for check in checks]


def _ms(figures: dict[str, float], name: str) -> str:
    return f"{figures[name]:.2f} ms" if name in figures else "-"


def cpu_cells(summary: dict, rate: bool = False) -> list[str]:
    """(The phase's calls per second,) CPU ms per call of each process, their sum, and the cores they and
    the whole machine kept busy."""
    ms, cores = summary["cpu_ms_per_call"], summary["cores"]
    return [*([f"{summary['calls'] / summary['wall_s']:.1f}"] if rate else []),
            *(_ms(ms, name) for name in PROCESSES), f"{sum(ms.values()):.2f} ms",
            f"{sum(v for k, v in cores.items() if k != 'machine'):.2f}", f"{cores['machine']:.2f}"]


def print_tables(result: dict) -> None:
    print_table(["agents", "requests", "direct p50", "direct p99", "direct req/s", "gateway p50", "gateway p99",
                 "gateway req/s", "added p50", "added p99", "ratio"],
                [[r["agents"], r["requests"], f"{r['direct_p50_ms']:.2f} ms", f"{r['direct_p99_ms']:.0f} ms",
                  f"{r['direct_rps']:.1f}", f"{r['gateway_p50_ms']:.2f} ms", f"{r['gateway_p99_ms']:.0f} ms",
                  f"{r['gateway_rps']:.1f}", f"{r['added_p50_ms']:.2f} ms", f"{r['added_p99_ms']:.0f} ms",
                  f"{r['throughput_ratio']:.2f}x"] for r in result["levels"]])
    print()
    print_table(["agents", "instances", "gateway req/s", "gateway p50", "gateway p99", "gateway CPU/call",
                 "cores (machine)", "1 instance req/s"],
                [[r["agents"], FLEET_INSTANCES, f"{r['gateway_rps']:.1f}", f"{r['gateway_p50_ms']:.2f} ms",
                  f"{r['gateway_p99_ms']:.0f} ms", _ms(r["cpu"]["gateway"]["cpu_ms_per_call"], "gateway"),
                  f"{r['cpu']['gateway']['cores']['machine']:.2f}",
                  f"{next(x for x in result['levels'] if x['agents'] == r['agents'])['gateway_rps']:.1f}"]
                 for r in result["fleet"]],
                title=f"{FLEET_INSTANCES} gateway instances (trajbus gateway --instances {FLEET_INSTANCES}), "
                      "trajectories opened at each in turn")
    print()
    cpu_columns = [f"{name} CPU/call" for name in PROCESSES] + ["sum CPU/call", "cores (these)", "cores (machine)"]
    print_table(["agents", "path", "calls", "req/s", *cpu_columns],
                [[r["agents"], path, r["cpu"][path]["calls"], *cpu_cells(r["cpu"][path], rate=True)]
                 for r in result["levels"] for path in ("direct", "gateway")],
                title="CPU per call by process (user + system, the kernel's accounting), per concurrency")
    print()
    print_table(["turn", "prompt tokens", "direct p50", "gateway p50", "added p50", "added p50, --multi-turn render",
                 *(f"{name} CPU/call" for name in PROCESSES), "direct: engine CPU/call", "direct: client CPU/call"],
                [[t["turn"], t["prompt_tokens"], f"{t['direct_p50_ms']:.2f} ms", f"{t['gateway_p50_ms']:.2f} ms",
                  f"{t['added_p50_ms']:.2f} ms", f"{t['render_added_p50_ms']:.2f} ms",
                  *(_ms(t["cpu"]["gateway"]["cpu_ms_per_call"], name) for name in PROCESSES),
                  _ms(t["cpu"]["direct"]["cpu_ms_per_call"], "engine"),
                  _ms(t["cpu"]["direct"]["cpu_ms_per_call"], "client")] for t in result["per_turn"]],
                title=f"1 agent, by turn number (CPU: {TURN_CONVERSATIONS} calls per turn, one at a time)")
    produce, one = result["produce"], result["levels"][0]
    print(f"\nacknowledged produce of one {produce['tokens']}-token step, one at a time: "
          f"p50 {produce['p50_ms']:.2f} ms, p99 {produce['p99_ms']:.2f} ms; "
          f"the gateway's added p50 at 1 agent: {one['added_p50_ms']:.2f} ms")
    for cost in result["stream_cost"]:
        phases = cost["phases_ms"]
        print(f"gateway CPU per call at {cost['agents']} agent(s), phases alternating: streamed (cut-and-continue) "
              f"{' '.join(f'{v:.2f}' for v in phases['always'])} ms, --engine-streaming when-asked "
              f"{' '.join(f'{v:.2f}' for v in phases['when-asked'])} ms")


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
        engine_port, gateway_port, rendering_port, when_asked_port = (free_port() for _ in range(4))
        fleet_port = free_ports(FLEET_INSTANCES + 1)
        engine = scripted_engine_process(engine_port, workdir, model, [REPLY]).start()
        processes.append(engine)
        for port, name, flags in ((gateway_port, "cumulative", []),
                                  (rendering_port, "render", ["--multi-turn", "render"]),
                                  (fleet_port, "fleet", ["--instances", str(FLEET_INSTANCES)]),
                                  (when_asked_port, "when-asked", ["--engine-streaming", "when-asked"])):
            processes.append(gateway_process(
                bootstrap, f"bench-{uuid.uuid4().hex[:6]}", [f"127.0.0.1:{engine_port}"], model, port,
                workdir / f"gateway-state-{name}", workdir / f"gateway-{name}.log",
                ["--prompt-length", "16384", "--response-length", "512", *flags]).start())
        fleet = [f"http://127.0.0.1:{fleet_port + 1 + i}" for i in range(FLEET_INSTANCES)]
        urls = [f"http://127.0.0.1:{port}" for port in (gateway_port, rendering_port, when_asked_port)]
        for url in [*urls, *fleet]:
            wait_http(f"{url}/ready", 120)
        wait_http(f"http://127.0.0.1:{engine_port}/health", 120, engine)
        shared = {**pids, "engine": engine.pid}
        meters = {name: CpuMeter({**shared, "gateway": process.pid})  # the fleet's instances: its descendants
                  for name, process in zip(("single", "render", "fleet", "when-asked"), processes[1:])}
        print(f"\ngateway: {TURNS}-turn conversations growing to {len(prompts[-1])} prompt tokens, "
              f"{len(REPLY)}-token replies from an instant engine; direct vs through the gateway")
        result = asyncio.run(measure(f"127.0.0.1:{engine_port}", urls[0], urls[1], fleet, urls[2], turns, prompts,
                                     meters))
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
