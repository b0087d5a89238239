"""The gateway at fleet size: thousands of agents on one instance, each conversation growing to ~32k tokens.

One gateway instance with its default limits, in front of an instant engine (``infra.scripted_engine``: a
300-token reply, one id per character) and a broker. At each level (256 agents, then 4,096), every agent opens a
trajectory and runs a 16-turn conversation, each turn adding a ~1.7k-token tool output and the reply, so the
last prompt is ~32k tokens; all agents call at once, so every agent's call is in flight together. Per level:

- the gateway's CPU per call (``benchmarks.cpu_meter``, the kernel's accounting), and the cycle collector's part
  (its pauses, ``trajbus_gateway_gc_pause_seconds``); the longest pause of the collections paced while the calls
  ran (``infra.collector``, bounded by a bucket of the histogram) and the full collections' mean (at most one every
  ``FULL_SECONDS``: once quiet, before the heap's release, when due; else among the calls); beside it the engine's CPU per call,
  the same work per call at every level: what the level's concurrency alone costs a call on this machine;
- its RSS grown over the level (all trajectories still open, their contexts whole), per agent and per
  context token (the target counts every copy the process keeps of a context: <= 8 bytes a token), read once
  the gateway, quiet, gave back the heap its calls freed (``gateway.http.quiet``), and at its peak while every
  call was in flight (what the calls hold meanwhile: their requests, prompts, engine bodies);
- bytes on the steps topic per step, against the step's distinct tokens (its new prompt tokens and its reply):
  a keyframe storm (steps sent whole once the prefix memory is full) shows as bytes growing with the context;
- the latency of the last turn's calls through the gateway, beside the same prompts sent straight to the
  engine at the same concurrency; calls that failed; the most calls in flight (``trajbus_gateway_calls_in_flight``).

Then the targets of issue 47 (item 1) against this run's figures. Prints two tables and writes
benchmarks/results/fleet.json. ``--levels 64,512`` runs smaller levels (a quick look, not the targets).
Uses TRAJBUS_BOOTSTRAP_SERVERS when set, else a throw-away embedded broker.
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
from collections import Counter
from pathlib import Path

import aiohttp
import orjson
import psutil

from benchmarks.assembly_bench import RESULTS, percentile
from benchmarks.cpu_meter import CpuMeter
from benchmarks.gateway_bench import post
from benchmarks.gateway_workload import REPLY, conversation, engine_prompts
from benchmarks.paced_bench import gc_during, gc_reading
from benchmarks.targets import Target, print_targets
from trajbus.gateway.engine.pool import KEEPALIVE_SECONDS, request_body
from trajbus.gateway.http.quiet import MIN_SECONDS as QUIET_MIN_SECONDS
from trajbus.gateway.server import raise_open_files_limit
from trajbus.infra import clients, tiny_model
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.topics import end_offsets_of, read_partition
from trajbus.pipelines.processes import free_port, gateway_process, scripted_engine_process, wait_http
from trajbus.pipelines.tables import print_table
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import PROMPT_FULL, StepDelta
from trajbus.streams.wire.topics import steps_topic

TURNS = 16
LEVELS = (256, 4096)
OUTPUT = "$ make check\n" + "".join(f"src/module_{i:02d}.py:{10 + i}: warning: unused import 'os' [W0611]\n"
                                     for i in range(34))
"""A turn's tool output: ~1.7k tokens of the tiny model (the reply adds 300: ~2k tokens a turn)."""
CHANNEL = "train"
CALL_EVERY_SECONDS = 10.0
"""The reference workload for sizing: each agent makes one call every ~10 s (an engine's reply and the agent's
tool take the rest), so 1,000 agents make 100 calls a second."""
METRICS_EVERY = 0.5
RELEASES = "trajbus_gateway_heap_releases_total"
PACED_GENERATIONS, FULL = ("0", "1"), ("2",)
"""The collections while calls are in flight (a burst's: the pacer freezes, ``infra.collector``), and the full ones
(at most every ``FULL_SECONDS``, quiet or not)."""


async def gateway_metrics(client: aiohttp.ClientSession, gateway: str) -> Counter:
    """The gateway's ``/metrics`` samples, summed by name over their labels."""
    async with client.get(f"{gateway}/metrics") as response:
        text = await response.text()
    samples: Counter = Counter()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name.partition("{")[0]] += float(value)
    return samples


async def watch_level(client: aiohttp.ClientSession, gateway: str, process: psutil.Process, done: asyncio.Event
                      ) -> tuple[float, int]:
    """The highest ``trajbus_gateway_calls_in_flight`` and the gateway's highest RSS read while the level runs."""
    most, peak_rss = 0.0, 0
    while not done.is_set():
        peak_rss = max(peak_rss, process.memory_info().rss)
        try:
            most = max(most, (await gateway_metrics(client, gateway))["trajbus_gateway_calls_in_flight"])
        except aiohttp.ClientError:  # a reading lost under load: the next one counts
            pass
        await asyncio.sleep(METRICS_EVERY)
    return most, peak_rss


async def heap_released(client: aiohttp.ClientSession, gateway: str, before: float) -> Counter:
    """Once the gateway, quiet after the calls, gave its free heap back (``gateway.http.quiet``: within
    ``MIN_SECONDS`` of the last time; ``before``, the releases counted until then), its metrics; the RSS then counts
    what the gateway keeps, not what its calls freed."""
    deadline = time.monotonic() + QUIET_MIN_SECONDS + 60
    while (metrics := await gateway_metrics(client, gateway))[RELEASES] <= before:
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not release its free heap once its calls ended")
        await asyncio.sleep(0.2)
    return metrics


async def agents_run(client: aiohttp.ClientSession, gateway: str, agents: int, bodies: list[bytes]
                     ) -> tuple[list[str], list[float], Counter, float]:
    """Every agent's trajectory opened, then all of them through their conversations at once: the base URLs,
    the last turn's latencies, the failed calls by what failed them, and the phase's wall seconds. An agent whose
    call failed stops there."""
    urls = [orjson.loads(await post(client, f"{gateway}/init_trajectory", orjson.dumps(
        {"prompt_uid": uuid.uuid4().hex, "n_rollouts": 1, "channel": CHANNEL})))["base_url"] for _ in range(agents)]
    last_turn: list[float] = []
    failed: Counter = Counter()

    async def agent(url: str) -> None:
        for turn, body in enumerate(bodies):
            started = time.perf_counter()
            try:
                await post(client, f"{url}/chat/completions", body)
            except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                failed[f"{type(exc).__name__}: {str(exc).rpartition(' answered ')[2][:120]}"] += 1
                return
            if turn == len(bodies) - 1:
                last_turn.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(agent(url) for url in urls))
    return urls, last_turn, failed, time.perf_counter() - started


async def direct_last_turn(client: aiohttp.ClientSession, engine: str, agents: int, prompt: list[int]) -> list[float]:
    """The last turn's prompt straight to the engine by every agent at once: the engine's own latency."""
    body = orjson.dumps(request_body(prompt, {"max_tokens": 512}, None, stream=False))

    async def one() -> float:
        started = time.perf_counter()
        await post(client, f"http://{engine}/v1/completions", body)
        return time.perf_counter() - started

    return list(await asyncio.gather(*(one() for _ in range(agents))))


def steps_bytes(bootstrap: str, topic: str, since: dict[tuple[str, int], int]) -> dict:
    """Records of ``topic`` written after the offsets ``since``: steps, their bytes, their distinct tokens
    (new prompt tokens and reply) and how many were keyframes after a trajectory's first step."""
    ends = end_offsets_of(bootstrap, list(since))
    reader = clients.reader(bootstrap, {"enable.partition.eof": True})
    steps = value_bytes = distinct = keyframes = 0
    try:
        for (name, partition), end in ends.items():
            for message in read_partition(reader, name, partition, since[(name, partition)], end):
                record = codec.decode(message.value())
                step = record.step if isinstance(record, StepDelta) else record
                if not hasattr(step, "response_ids"):
                    continue  # a trajectory's end
                steps += 1
                value_bytes += len(message.value())
                distinct += len(step.prompt_ids) + len(step.response_ids)
                whole = not isinstance(record, StepDelta) or record.kind == PROMPT_FULL
                keyframes += whole and step.step_index > 0
    finally:
        reader.close()
    return {"steps": steps, "bytes_per_step": value_bytes / max(steps, 1),
            "bytes_per_distinct_token": value_bytes / max(distinct, 1), "keyframes_after_first": keyframes}


async def level(engine: str, gateway: str, bootstrap: str, prefix: str, agents: int, turns: list[list[dict]],
                prompts: list[list[int]], reply: list[int], meter: CpuMeter, gateway_pid: int) -> dict:
    """One level: agents' conversations through the gateway (measured), then the engine alone on the last turn."""
    bodies = [orjson.dumps({"model": "bench", "messages": t, "max_tokens": 512}) for t in turns]
    topic = steps_topic(CHANNEL, prefix)
    reader = clients.reader(bootstrap)
    partitions = [(topic, p) for p in reader.list_topics(topic, timeout=10).topics[topic].partitions]
    reader.close()
    since = end_offsets_of(bootstrap, partitions)
    process = psutil.Process(gateway_pid)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS)  # closed before the server does
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1800)) as client:
        releases = (await gateway_metrics(client, gateway))[RELEASES]
        urls, _, _, _ = await agents_run(client, gateway, 1, bodies[:1])  # a call, then a quiet instance whose
        metrics_before = await heap_released(client, gateway, releases)  # freed heap went back: what earlier
        rss_before = process.memory_info().rss  # levels freed is not counted as this level's
        gc_before = await gc_reading(client, gateway)
        done = asyncio.Event()
        watcher = asyncio.create_task(watch_level(client, gateway, process, done))
        before = meter.snapshot()
        level_urls, via, failures, wall = await agents_run(client, gateway, agents, bodies)
        urls += level_urls
        paced = gc_during(gc_before, await gc_reading(client, gateway), PACED_GENERATIONS)
        done.set()
        in_flight, peak_rss = await watcher
        peak_rss = max(peak_rss, process.memory_info().rss)  # sampled: the end may be the top
        await heap_released(client, gateway, metrics_before[RELEASES])
        gc_after = await gc_reading(client, gateway)
        rss_grown = process.memory_info().rss - rss_before
        phase = meter.since(before)  # the release's CPU counted with the calls'
        direct = await direct_last_turn(client, engine, agents, prompts[-1])
        for url in urls:  # the state freed for the next level (a trajectory whose first call failed has none)
            async with client.post(f"{url}/complete_trajectory", json={"reward": 1.0}) as response:
                await response.read()
    full = gc_during(gc_before, gc_after, FULL)
    context = len(prompts[-1]) + len(reply)
    calls = agents * TURNS
    cpu = phase.summary(calls)
    row = {"agents": agents, "calls": calls, "failed": sum(failures.values()), "failures": dict(failures),
           "wall_s": wall, "most_in_flight": in_flight,
           "cpu": cpu, "context_tokens": context,
           "collector_ms_per_call": 1000 * gc_during(gc_before, gc_after)["seconds"] / calls,
           "paced_collections": sum(paced["collections"].values()), "paced_longest_bound_ms": 1000 * paced["longest_s"],
           "full_collections": sum(full["collections"].values()), "full_seconds": full["seconds"],
           "cores_per_1000_agents": 1000 / CALL_EVERY_SECONDS * cpu["cpu_ms_per_call"]["gateway"] / 1000,
           "rss_grown_mb": rss_grown / 2**20, "rss_peak_grown_mb": (peak_rss - rss_before) / 2**20,
           "rss_per_agent_kb": rss_grown / agents / 1024,
           "rss_per_context_token": rss_grown / (agents * context),
           "gateway_last_p50_ms": 1000 * statistics.median(via), "gateway_last_p99_ms": 1000 * percentile(via, 0.99),
           "direct_last_p50_ms": 1000 * statistics.median(direct),
           "direct_last_p99_ms": 1000 * percentile(direct, 0.99),
           **steps_bytes(bootstrap, topic, since)}
    print(f"  {agents} agents: {calls} calls in {wall:.0f} s, {row['failed']} failed {failures or ''}, gateway CPU "
          f"{row['cpu']['cpu_ms_per_call']['gateway']:.2f} ms/call, RSS +{row['rss_grown_mb']:.0f} MB, "
          f"{row['bytes_per_step']:.0f} B/step", flush=True)
    return row


def targets(rows: list[dict]) -> list[Target]:
    """Issue 47's item 1 targets: the largest level against the smallest."""
    small, large = rows[0], rows[-1]
    cpu = {r["agents"]: r["cpu"]["cpu_ms_per_call"]["gateway"] for r in rows}
    return [
        Target(f"calls failed at {r['agents']} agents", "0", str(r["failed"]), r["failed"] == 0) for r in rows
    ] + [
        Target(f"calls in flight at once at {large['agents']} agents", f">= {large['agents']}",
               f"{large['most_in_flight']:.0f}", large["most_in_flight"] >= large["agents"]),
        Target(f"gateway CPU per call, {large['agents']} / {small['agents']} agents", "<= 1.2x",
               f"{cpu[large['agents']] / cpu[small['agents']]:.3f}x ({cpu[large['agents']]:.2f} vs "
               f"{cpu[small['agents']]:.2f} ms)", cpu[large["agents"]] <= 1.2 * cpu[small["agents"]]),
        Target(f"bytes per step, {large['agents']} / {small['agents']} agents", "<= 1.1x",
               f"{large['bytes_per_step'] / small['bytes_per_step']:.3f}x ({large['bytes_per_step']:.0f} vs "
               f"{small['bytes_per_step']:.0f} B)", large["bytes_per_step"] <= 1.1 * small["bytes_per_step"]),
        Target(f"gateway memory per context token at {large['agents']} agents", "<= 8 B",
               f"{large['rss_per_context_token']:.1f} B ({large['rss_grown_mb']:.0f} MB for "
               f"{large['agents']} x {large['context_tokens']} tokens)", large["rss_per_context_token"] <= 8),
    ]


def print_rows(rows: list[dict]) -> None:
    print_table(["agents", "calls", "failed", "most in flight", "gateway CPU/call", "of it collector",
                 "longest paced pause (collections)", "full collections: mean", "engine CPU/call",
                 "cores/1,000 agents", "req/s",
                 "RSS grown", "at its peak", "RSS/agent", "RSS/context token", "bytes/step", "bytes/distinct token",
                 "keyframes after first",
                 "last turn p50", "p99", "engine alone p50", "p99"],
                [[r["agents"], r["calls"], r["failed"], f"{r['most_in_flight']:.0f}",
                  f"{r['cpu']['cpu_ms_per_call']['gateway']:.2f} ms", f"{r['collector_ms_per_call']:.2f} ms",
                  f"<= {r['paced_longest_bound_ms']:.1f} ms ({r['paced_collections']:.0f})",
                  f"{r['full_collections']:.0f}: {1000 * r['full_seconds'] / max(r['full_collections'], 1):.0f} ms",
                  f"{r['cpu']['cpu_ms_per_call']['engine']:.2f} ms",
                  f"{r['cores_per_1000_agents']:.2f}",
                  f"{r['calls'] / r['wall_s']:.1f}",
                  f"{r['rss_grown_mb']:.0f} MB", f"{r['rss_peak_grown_mb']:.0f} MB",
                  f"{r['rss_per_agent_kb']:.0f} KiB",
                  f"{r['rss_per_context_token']:.1f} B", f"{r['bytes_per_step']:.0f}",
                  f"{r['bytes_per_distinct_token']:.2f}", r["keyframes_after_first"],
                  f"{r['gateway_last_p50_ms']:.0f} ms", f"{r['gateway_last_p99_ms']:.0f} ms",
                  f"{r['direct_last_p50_ms']:.0f} ms", f"{r['direct_last_p99_ms']:.0f} ms"] for r in rows],
                title=f"One gateway instance, {TURNS}-turn conversations to {rows[0]['context_tokens']} tokens, "
                      f"every agent calling at once (instant engine); cores per 1,000 agents at one call each every "
                      f"{CALL_EVERY_SECONDS:g} s")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="agents per level, comma-separated")
    levels = [int(n) for n in parser.parse_args(argv).levels.split(",")]
    raise_open_files_limit(max(levels))  # this client holds a socket per agent
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-bench-fleet-"))
    broker, processes, rows = None, [], []
    bootstrap = os.environ.get("TRAJBUS_BOOTSTRAP_SERVERS")
    prefix = f"bench-fleet-{uuid.uuid4().hex[:6]}"
    try:
        if not bootstrap:
            broker = EmbeddedKafka(state_dir=workdir / "broker")
            bootstrap = broker.start().bootstrap_servers
        model = tiny_model.build()
        turns = conversation(TURNS, OUTPUT)
        prompts, reply = engine_prompts(model, turns)
        engine_port, gateway_port = free_port(), free_port()
        processes.append(scripted_engine_process(engine_port, workdir, model, [REPLY]).start())
        processes.append(gateway_process(bootstrap, prefix, [f"127.0.0.1:{engine_port}"], model, gateway_port,
                                         workdir / "gateway-state", workdir / "gateway.log",
                                         ["--prompt-length", "40000", "--response-length", "512"]).start())
        gateway = f"http://127.0.0.1:{gateway_port}"
        wait_http(f"{gateway}/ready", 120)
        wait_http(f"http://127.0.0.1:{engine_port}/health", 120, processes[0])
        meter = CpuMeter({"gateway": processes[1].pid, "engine": processes[0].pid})
        print(f"\nfleet: {TURNS}-turn conversations growing to {len(prompts[-1])} prompt tokens, levels {levels}")
        for agents in levels:
            rows.append(asyncio.run(level(f"127.0.0.1:{engine_port}", gateway, bootstrap, prefix, agents, turns,
                                          prompts, reply, meter, processes[1].pid)))
    finally:
        for process in reversed(processes):
            process.stop()
        if broker is not None:
            broker.stop()
    print_rows(rows)
    result = {"levels": rows, "targets": print_targets(targets(rows), "Targets (issue 47, item 1)")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fleet.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
