"""Latency as an agent feels it: one gateway instance at ~80 % of its capacity, in front of a paced engine.

The other gateway benchmarks use an instant engine, so every figure there is the gateway's cost. An agent
feels something else: its call lasts as long as the engine generates, and what it loses to the gateway is
the latency added on top, including the calls queued behind the gateway's busy moments and its collector's
pauses. Here the engine (``infra.scripted_engine``) paces its 300-token replies at 60 tokens/s
(``token_delay``), so a call lasts ~5 s.

1. Capacity: ``--capacity-agents`` agents call back to back through a gateway in front of an instant
   engine for ``--capacity-seconds``; the calls/s it served is the instance's capacity on this machine
   (every process of the run shares its cores; the gateway's CPU per call is printed beside it).
2. The level: ``agents = --load x capacity x call duration`` (a call takes ~5 s, so 100 calls/s of
   capacity at 80 % are 400 agents), at most ``--max-agents`` (the paced engine is one Python process
   whose threads wake once a stream interval per call in flight, on the cores the gateway uses too: the cap
   keeps a small machine's figures the gateway's, not a starved engine's; the table says when it applied).
   Each agent runs ``gateway_workload``'s 10-turn conversations, one non-streaming chat call after another,
   through its trajectory's black-box ``base_url``; the agents start spread over one call's duration so
   calls arrive steadily, only calls started in the next ``--seconds`` are measured, and the agents go on
   for one call's duration more so the last of them meet the same load as the first.
   Baseline, first: the same agents, turns and concurrency straight to the engine, each call the
   request the gateway makes of it (the turn's prompt ids), answered whole as the gateway answers its agents,
   so the client does the same work per call on both paths (reading 256 streams of events costs the
   benchmark's own process tens of milliseconds a call).

Per level: calls, p50/p99 through the gateway and straight to the engine, the latency the gateway adds at
each percentile (targets p50 <= 5 ms, p99 <= 20 ms, issue 47 item 4), and the longest pause of the
gateway's cycle collector during the level (target <= 20 ms), from its ``/metrics``
(``trajbus_gateway_gc_pause_seconds`` and ``_max_seconds``). Prints the table and the targets; writes
benchmarks/results/paced.json. The defaults hold about 2 minutes of load (two paths of 40 measured seconds,
with their ramps, and the capacity phase); ``--seconds 300`` for a long look. Uses the
user's broker (TRAJBUS_BOOTSTRAP_SERVERS, ``trajbus broker up``) when there is one, else an embedded one.

The added latency is measured per call. Every call carries its own ``seed``; the engine times each seeded call
from its body read to its last byte (``infra.scripted_engine``, ``GET /timings``), and a call's time outside
the engine is its latency less that. The added latency at a percentile is that of the calls through the gateway
less that of the calls straight to the engine. The paced engine's own time swings by tens of milliseconds
between the two phases; the difference of the phases' whole latencies, printed beside it, carries that swing.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import statistics
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp
import orjson

from benchmarks.assembly_bench import RESULTS, percentile
from benchmarks.bench_broker import bench_broker
from benchmarks.cpu_meter import CpuMeter
from benchmarks.gateway_bench import post
from benchmarks.gateway_workload import REPLY, TURNS, conversation, engine_prompts
from benchmarks.targets import Target, print_targets
from trajbus.gateway.engine.pool import KEEPALIVE_SECONDS, request_body
from trajbus.gateway.gc_pauses import HISTOGRAM, LONGEST
from trajbus.gateway.server import raise_open_files_limit
from trajbus.infra import tiny_model
from trajbus.pipelines.processes import ServiceProcess, free_port, gateway_process, scripted_engine_process, wait_http
from trajbus.pipelines.tables import print_table

TOKEN_DELAY = 1 / 60
LOAD = 0.8
SECONDS = 40.0
CAPACITY_SECONDS = 10.0
CAPACITY_AGENTS = 64
CAPACITY_RAMP = 2.0
"""Seconds the capacity phase's agents take to start, its calls not counted (the gateway's first calls)."""
MAX_AGENTS = 256
STREAM_INTERVAL = 16
"""Tokens per engine event: the gateway's default ``--engine-stream-interval``, given to it."""
ADDED_P50_MS, ADDED_P99_MS, GC_PAUSE_MS = 5.0, 20.0, 20.0
FAILURE_BACKOFF = 0.5
"""Seconds an agent waits after a failed call before its next conversation (no tight loop of failures)."""
Opener = Callable[[aiohttp.ClientSession], Awaitable[str]]
Caller = Callable[[aiohttp.ClientSession, str, int, int], Awaitable[bytes]]
"""A call of a turn: (client, base URL, turn, seed), the seed the call's own (``SEEDS``)."""
SEEDS = itertools.count(1)
"""Every call of the run asks with a seed of its own: the engine's timing of it (``GET /timings``)."""


def call_seconds(token_delay: float) -> float:
    """A paced call's duration: the reply's ids (the scripted engine's one a character, and EOS) x the delay."""
    return (len(REPLY) + 1) * token_delay


@dataclass
class Phase:
    """Agents calling back to back: the latencies of the calls started in the measured window, every call."""

    latencies: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    """Each measured call's seed, beside its latency."""
    calls: int = 0
    failures: Counter = field(default_factory=Counter)


async def agents_run(client: aiohttp.ClientSession, agents: int, ramp_s: float, window_s: float, opener: Opener,
                     caller: Caller) -> Phase:
    """``agents`` start spread over ``ramp_s``; each runs conversations (``opener``: a new one's base URL) turn
    after turn; the calls started in the ``window_s`` after the ramp are measured, and the agents go on calling
    for ``ramp_s`` more, so the last measured calls run under the same load as the first."""
    phase = Phase()
    begin = time.perf_counter() + ramp_s
    end = begin + window_s
    stop = end + ramp_s

    async def agent(index: int) -> None:
        await asyncio.sleep(ramp_s * index / agents)
        while time.perf_counter() < stop:
            try:
                base = await opener(client)
                for turn in range(TURNS):
                    started, seed = time.perf_counter(), next(SEEDS)
                    if started >= stop:
                        return
                    await caller(client, base, turn, seed)
                    phase.calls += 1
                    if begin <= started < end:
                        phase.latencies.append(time.perf_counter() - started)
                        phase.seeds.append(seed)
            except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                phase.failures[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
                await asyncio.sleep(FAILURE_BACKOFF)

    await asyncio.gather(*(agent(i) for i in range(agents)))
    return phase


def seeded(body: bytes, seed: int) -> bytes:
    """A JSON object's bytes with ``"seed"`` added (the gateway passes it to the engine)."""
    return body[:-1] + b',"seed":%d}' % seed


async def outside_engine(client: aiohttp.ClientSession, engine: str, phase: Phase) -> list[float]:
    """Each measured call's seconds outside the engine: its latency less the engine's time for its seed."""
    async with client.get(f"http://{engine}/timings") as response:
        seconds = {int(seed): value for seed, value in (await response.json()).items()}
    return [latency - seconds[seed] for seed, latency in zip(phase.seeds, phase.latencies) if seed in seconds]


def straight(engine: str, prompts: list[list[int]]) -> tuple[Opener, Caller]:
    """Straight to the engine: each turn's request as the gateway makes it (prompt ids), answered whole."""
    bodies = [orjson.dumps(request_body(p, {"max_tokens": 512}, None, stream=False)) for p in prompts]

    async def no_trajectory(_client: aiohttp.ClientSession) -> str:
        return ""

    def call(client: aiohttp.ClientSession, _base: str, turn: int, seed: int) -> Awaitable[bytes]:
        return post(client, f"http://{engine}/v1/completions", seeded(bodies[turn], seed))

    return no_trajectory, call


def through(gateway: str, turns: list[list[dict]]) -> tuple[Opener, Caller]:
    """Through the gateway: a trajectory opened per conversation, each turn's messages to its ``base_url``."""
    bodies = [orjson.dumps({"model": "bench", "messages": t, "max_tokens": 512}) for t in turns]

    async def trajectory(client: aiohttp.ClientSession) -> str:
        body = orjson.dumps({"prompt_uid": uuid.uuid4().hex, "n_rollouts": 1})
        return orjson.loads(await post(client, f"{gateway}/init_trajectory", body))["base_url"]

    def call(client: aiohttp.ClientSession, base: str, turn: int, seed: int) -> Awaitable[bytes]:
        return post(client, f"{base}/chat/completions", seeded(bodies[turn], seed))

    return trajectory, call


def session() -> aiohttp.ClientSession:
    """Connections dropped before the servers drop them; a call may wait long on a saturated machine."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS),
                                 timeout=aiohttp.ClientTimeout(total=300))


async def capacity(gateway: str, turns: list[list[dict]], args: argparse.Namespace, meter: CpuMeter) -> dict:
    """Calls/s one instance serves in front of an instant engine, with its CPU per call."""
    opener, caller = through(gateway, turns)
    async with session() as client:
        before = meter.snapshot()
        phase = await agents_run(client, args.capacity_agents, CAPACITY_RAMP, args.capacity_seconds, opener, caller)
        cpu = meter.since(before).summary(max(phase.calls, 1))
    rate = len(phase.latencies) / args.capacity_seconds
    failed = sum(phase.failures.values())
    print(f"  capacity: {rate:.1f} calls/s ({args.capacity_agents} agents, instant engine), gateway CPU "
          f"{cpu['cpu_ms_per_call']['gateway']:.2f} ms/call, {cpu['cores']['gateway']:.2f} cores, machine "
          f"{cpu['cores']['machine']:.2f} cores; {failed} calls failed {dict(phase.failures) or ''}", flush=True)
    return {"calls_per_s": rate, "agents": args.capacity_agents, "seconds": args.capacity_seconds,
            "failed": failed, "cpu": cpu}


GC_BUCKET = re.compile(rf'^{HISTOGRAM}_bucket\{{generation="(\d+)",le="([^"]+)"\}} (\S+)$', re.M)
GC_SUM = re.compile(rf'^{HISTOGRAM}_sum\{{generation="(\d+)"\}} (\S+)$', re.M)
GC_LONGEST = re.compile(rf"^{LONGEST} (\S+)$", re.M)


async def gc_reading(client: aiohttp.ClientSession, gateway: str) -> dict:
    """The gateway's collector pauses so far: cumulative counts per (generation, bound), seconds per generation,
    the longest."""
    async with client.get(f"{gateway}/metrics") as response:
        text = await response.text()
    buckets = {(g, float(le)): float(n) for g, le, n in GC_BUCKET.findall(text)}
    sums = {g: float(seconds) for g, seconds in GC_SUM.findall(text)}
    longest = GC_LONGEST.search(text)
    return {"buckets": buckets, "sums": sums, "longest": float(longest.group(1)) if longest else 0.0}


def gc_during(before: dict, after: dict, generations: tuple[str, ...] | None = None) -> dict:
    """The collections between two readings (of ``generations``, else all), their seconds, those over the target,
    and the longest: exact when all are counted and the gauge of the longest grew meanwhile, else bounded by the
    highest bucket that counted one (and by the gauge)."""
    every = generations is None  # the gauge of the longest counts every generation's
    delta = {key: n - before["buckets"].get(key, 0.0) for key, n in after["buckets"].items()
             if every or key[0] in generations}
    generations = tuple(sorted({g for g, _ in delta}))
    totals = {g: delta.get((g, float("inf")), 0.0) for g in generations}
    over = sum(totals[g] - delta.get((g, GC_PAUSE_MS / 1000), 0.0) for g in generations)
    seconds = sum(after["sums"].get(g, 0.0) - before["sums"].get(g, 0.0) for g in generations)
    if every and after["longest"] > before["longest"]:
        longest, exact = after["longest"], True
    else:
        bounds = [min(le for (gen, le), n in delta.items() if gen == g and n >= totals[g])
                  for g in generations if totals[g] > 0]
        longest, exact = min(max(bounds, default=0.0), after["longest"]), False
    return {"collections": {g: totals[g] for g in generations}, "seconds": seconds, "over_target": over,
            "longest_s": longest, "longest_exact": exact}


async def level(engine: str, gateway: str, turns: list[list[dict]], prompts: list[list[int]], agents: int,
                args: argparse.Namespace, meter: CpuMeter) -> dict:
    """The same agents straight to the engine, then through the gateway; the collector read around the latter."""
    call_s = call_seconds(args.token_delay)
    (direct_open, direct_call), (via_open, via_call) = straight(engine, prompts), through(gateway, turns)
    async with session() as client:
        before = meter.snapshot()
        direct = await agents_run(client, agents, call_s, args.seconds, direct_open, direct_call)
        direct_cpu = meter.since(before).summary(max(direct.calls, 1))
        print(f"  engine alone: {len(direct.latencies)} calls measured", flush=True)
        gc_before, before = await gc_reading(client, gateway), meter.snapshot()
        via = await agents_run(client, agents, call_s, args.seconds, via_open, via_call)
        via_cpu = meter.since(before).summary(max(via.calls, 1))
        gc = gc_during(gc_before, await gc_reading(client, gateway))
        print(f"  through the gateway: {len(via.latencies)} calls measured", flush=True)
        d_out, g_out = await outside_engine(client, engine, direct), await outside_engine(client, engine, via)
    d, g = direct.latencies, via.latencies
    row = {"agents": agents, "call_s": call_s, "direct_calls": len(d), "gateway_calls": len(g),
           "failed": sum(direct.failures.values()) + sum(via.failures.values()),
           "failures": dict(direct.failures + via.failures),
           "direct_p50_ms": 1000 * statistics.median(d), "direct_p99_ms": 1000 * percentile(d, 0.99),
           "gateway_p50_ms": 1000 * statistics.median(g), "gateway_p99_ms": 1000 * percentile(g, 0.99),
           "gc": gc, "cpu": {"direct": direct_cpu, "gateway": via_cpu}}
    row["phases_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
    row["phases_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
    row["timed_calls"] = {"direct": len(d_out), "gateway": len(g_out)}
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        row[f"outside_direct_{name}_ms"] = 1000 * percentile(d_out, q)
        row[f"outside_gateway_{name}_ms"] = 1000 * percentile(g_out, q)
        row[f"added_{name}_ms"] = row[f"outside_gateway_{name}_ms"] - row[f"outside_direct_{name}_ms"]
    return row


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def gc_text(gc: dict) -> str:
    """The longest collector pause: exact, or the bound its buckets give."""
    if not any(gc["collections"].values()):
        return "no collection"
    return f"{'' if gc['longest_exact'] else '<= '}{1000 * gc['longest_s']:.1f} ms"


def print_level(row: dict, sizing: dict) -> None:
    gc, cores = row["gc"], row["cpu"]["gateway"]["cores"]
    print_table(
        ["agents", "calls: engine alone / via gateway", "engine alone p50", "p99", "via gateway p50", "p99",
         "outside the engine p50: alone / via", "p99: alone / via",
         f"added p50 (<= {ADDED_P50_MS:g} ms)", f"added p99 (<= {ADDED_P99_MS:g} ms)", "phases' difference p50 / p99",
         f"longest GC pause (<= {GC_PAUSE_MS:g} ms)", "failed", "cores busy: gateway / engine / machine"],
        [[row["agents"], f"{row['direct_calls']} / {row['gateway_calls']}",
          f"{row['direct_p50_ms']:.1f} ms", f"{row['direct_p99_ms']:.1f} ms",
          f"{row['gateway_p50_ms']:.1f} ms", f"{row['gateway_p99_ms']:.1f} ms",
          f"{row['outside_direct_p50_ms']:.2f} / {row['outside_gateway_p50_ms']:.2f} ms",
          f"{row['outside_direct_p99_ms']:.2f} / {row['outside_gateway_p99_ms']:.2f} ms",
          f"{row['added_p50_ms']:.2f} ms {verdict(row['added_p50_ms'] <= ADDED_P50_MS)}",
          f"{row['added_p99_ms']:.2f} ms {verdict(row['added_p99_ms'] <= ADDED_P99_MS)}",
          f"{row['phases_p50_ms']:.1f} / {row['phases_p99_ms']:.1f} ms",
          f"{gc_text(gc)} {verdict(gc['over_target'] == 0)}", row["failed"],
          f"{cores['gateway']:.2f} / {cores['engine']:.2f} / {cores['machine']:.2f}"]],
        title=f"Paced engine: {len(REPLY)}-token replies at {1 / sizing['token_delay']:.0f} tokens/s "
              f"({row['call_s']:.2f} s a call), agents calling back to back, {sizing['load_of_capacity']:.0%} of "
              f"one instance's capacity ({sizing['capacity_calls_per_s']:.1f} calls/s)")
    if sizing["capped"]:
        print(f"capped: {sizing['wanted_agents']} agents would be {sizing['load']:.0%} of capacity; this run has "
              f"{row['agents']} (--max-agents raises it): beyond, on a small machine, the paced engine would starve "
              f"and its own latency would be the figure")
    if row["failures"]:
        print(f"failures: {row['failures']}")


def targets(row: dict) -> list[Target]:
    """Issue 47's item 4: the latency the gateway adds an agent, and its collector's longest pause."""
    gc = row["gc"]
    at = f"{row['agents']} agents, paced engine"
    return [
        *(Target(f"added latency {name}, {at} (per call, outside the engine)", f"<= {bound:g} ms",
                 f"{row[f'added_{name}_ms']:.2f} ms ({row[f'outside_gateway_{name}_ms']:.2f} vs "
                 f"{row[f'outside_direct_{name}_ms']:.2f} ms; the phases' difference: {row[f'phases_{name}_ms']:.1f} ms)",
                 row[f"added_{name}_ms"] <= bound) for name, bound in (("p50", ADDED_P50_MS), ("p99", ADDED_P99_MS))),
        Target(f"longest GC pause in the gateway, {at}", f"<= {GC_PAUSE_MS:g} ms",
               f"{gc_text(gc)} ({gc['over_target']:.0f} of {sum(gc['collections'].values()):.0f} collections over)",
               gc["over_target"] == 0),
        Target(f"calls failed, {at}", "0", str(row["failed"]), row["failed"] == 0),
    ]


def sizing(capacity_rate: float, args: argparse.Namespace) -> dict:
    """The level's agents: ``--agents``, else ``--load`` of capacity x a call's duration, at most ``--max-agents``."""
    call_s = call_seconds(args.token_delay)
    wanted = max(1, round(args.load * capacity_rate * call_s))
    agents = args.agents or min(wanted, args.max_agents)
    return {"token_delay": args.token_delay, "load": args.load, "capacity_calls_per_s": capacity_rate,
            "wanted_agents": wanted, "agents": agents, "capped": not args.agents and wanted > args.max_agents,
            "load_of_capacity": agents / (capacity_rate * call_s) if capacity_rate else float("nan")}


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paced_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--load", type=float, default=LOAD, help="the level's share of the measured capacity")
    parser.add_argument("--agents", type=int, help="the level's agents (instead of --load of capacity)")
    parser.add_argument("--max-agents", type=int, default=MAX_AGENTS, help="at most this many agents from --load")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="measured seconds of each path's level")
    parser.add_argument("--capacity-seconds", type=float, default=CAPACITY_SECONDS)
    parser.add_argument("--capacity-agents", type=int, default=CAPACITY_AGENTS)
    parser.add_argument("--token-delay", type=float, default=TOKEN_DELAY, help="seconds the engine takes a token")
    return parser.parse_args(argv)


def start(bootstrap: str, workdir: Path, model: Path, name: str, replies: list, workers: int
          ) -> tuple[ServiceProcess, ServiceProcess, str, str]:
    """A scripted engine and a gateway in front of it (not yet ready): both processes, their addresses."""
    engine_port, gateway_port = free_port(), free_port()
    engine = scripted_engine_process(engine_port, workdir, model, replies, workers=workers).start()
    gateway = gateway_process(bootstrap, f"bench-paced-{name}-{uuid.uuid4().hex[:6]}", [f"127.0.0.1:{engine_port}"],
                              model, gateway_port, workdir / f"state-{name}", workdir / f"gateway-{name}.log",
                              ["--prompt-length", "16384", "--response-length", "512",
                               "--engine-stream-interval", str(STREAM_INTERVAL)]).start()
    return engine, gateway, f"127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"


def main(argv: list[str] | None = None) -> dict:
    args = arguments(argv)
    most = args.agents or args.max_agents
    raise_open_files_limit(most)  # this client holds a socket per agent
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-bench-paced-"))
    processes: list[ServiceProcess] = []
    with bench_broker(workdir) as bootstrap:
        try:
            model = tiny_model.build()
            turns = conversation()
            prompts, _ = engine_prompts(model, turns)
            instant = start(bootstrap, workdir, model, "instant", [REPLY], 1)
            paced = start(bootstrap, workdir, model, "paced", [{"text": REPLY, "token_delay": args.token_delay}],
                          most + 4)
            processes += [*instant[:2], *paced[:2]]
            for engine, gateway, engine_address, gateway_url in (instant, paced):
                wait_http(f"http://{engine_address}/health", 120, engine)
                wait_http(f"{gateway_url}/ready", 120, gateway)
            print(f"\npaced: {TURNS}-turn conversations to {len(prompts[-1])} prompt tokens, {len(REPLY)}-token "
                  f"replies at {1 / args.token_delay:.0f} tokens/s; capacity first, with an instant engine")
            measured = asyncio.run(capacity(instant[3], turns, args,
                                            CpuMeter({"gateway": instant[1].pid, "engine": instant[0].pid})))
            for process in reversed(instant[:2]):  # idle from here on: the level has the machine
                process.stop()
            plan = sizing(measured["calls_per_s"], args)
            print(f"  level: {plan['agents']} agents ({plan['load_of_capacity']:.0%} of capacity)", flush=True)
            row = asyncio.run(level(paced[2], paced[3], turns, prompts, plan["agents"], args,
                                    CpuMeter({"gateway": paced[1].pid, "engine": paced[0].pid})))
        finally:
            for process in reversed(processes):
                process.stop()
    print()
    print_level(row, plan)
    result = {"arguments": vars(args), "capacity": measured, "sizing": plan, "level": row,
              "targets": print_targets(targets(row), "Targets (issue 47, item 4: paced engine, this machine)")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "paced.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
