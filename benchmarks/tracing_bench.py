"""What tracing costs the gateway: CPU per call with ``--tracing off`` (the default) and ``--tracing kafka``.

The call pattern of ``benchmarks.gateway_bench``: agents run 10-turn conversations that grow to ~8k
prompt tokens, 300-token replies of an instant scripted engine, one acknowledged step per call. Two
gateways on one broker and one engine, identical but for ``--tracing``; phases alternate between them
(off, kafka, off, kafka, ...) so drift of a busy machine falls on both. Each phase: ``AGENTS`` agents
at once, one conversation each (``AGENTS`` x 10 calls). With tracing on every call exports its spans
(root at the first turn, call, engine, publish) to ``{prefix}.traces`` and each step carries its
``traceparent``.

Prints a table (gateway CPU ms per call and p50 latency per mode) and the ratio kafka / off beside its
target (at most 1.1x), and writes
benchmarks/results/tracing.json. Uses TRAJBUS_BOOTSTRAP_SERVERS when set, else a throw-away broker.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import uuid
from pathlib import Path

import aiohttp

from benchmarks.assembly_bench import RESULTS
from benchmarks.cpu_meter import CpuMeter
from benchmarks.gateway_bench import calls, open_trajectories, run
from benchmarks.gateway_workload import REPLY, TURNS, conversation, engine_prompts
from trajbus.gateway.engine.pool import KEEPALIVE_SECONDS
from trajbus.infra import tiny_model
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.pipelines.processes import ServiceProcess, free_port, gateway_process, scripted_engine_process, wait_http
from trajbus.pipelines.tables import print_table

MODES = ("off", "kafka")
AGENTS = 32
ROUNDS = 3
"""Phases per mode, alternating."""
TARGET_RATIO = 1.1


async def phase(client: aiohttp.ClientSession, engine: str, gateway: str, meter: CpuMeter,
                turns: list[list[dict]], prompts: list[list[int]]) -> dict:
    """``AGENTS`` conversations at once through ``gateway``: its CPU per call and the calls' p50."""
    _, via = calls(engine, await open_trajectories(client, [gateway], AGENTS), turns, prompts)
    before = meter.snapshot()
    by_turn, wall_s = await run(client, AGENTS, 1, via)
    used = meter.since(before)
    latencies = [x for xs in by_turn.values() for x in xs]
    return {"calls": len(latencies), "cpu_ms_per_call": used.per_call_ms(len(latencies))["gateway"],
            "p50_ms": 1000 * statistics.median(latencies), "rps": len(latencies) / wall_s}


async def measure(engine: str, gateways: dict[str, str], meters: dict[str, CpuMeter], turns: list[list[dict]],
                  prompts: list[list[int]]) -> dict[str, list[dict]]:
    connector = aiohttp.TCPConnector(limit=600, keepalive_timeout=KEEPALIVE_SECONDS)
    phases: dict[str, list[dict]] = {mode: [] for mode in MODES}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as client:
        for mode in MODES:  # warm-up, not reported
            await phase(client, engine, gateways[mode], meters[mode], turns, prompts)
        for round_index in range(ROUNDS):
            for mode in MODES:
                result = await phase(client, engine, gateways[mode], meters[mode], turns, prompts)
                phases[mode].append(result)
                print(f"  round {round_index + 1} --tracing {mode}: gateway CPU {result['cpu_ms_per_call']:.2f} "
                      f"ms/call, p50 {result['p50_ms']:.1f} ms", flush=True)
    return phases


def summary(phases: dict[str, list[dict]]) -> dict:
    modes = {mode: {"cpu_ms_per_call": statistics.median(p["cpu_ms_per_call"] for p in runs),
                    "p50_ms": statistics.median(p["p50_ms"] for p in runs),
                    "rps": statistics.median(p["rps"] for p in runs), "phases": runs}
             for mode, runs in phases.items()}
    ratio = modes["kafka"]["cpu_ms_per_call"] / modes["off"]["cpu_ms_per_call"]
    return {"modes": modes, "ratio_kafka_to_off": ratio, "target_ratio": TARGET_RATIO, "met": ratio <= TARGET_RATIO}


def start(workdir: Path, servers: str, model: Path) -> tuple[ServiceProcess, dict[str, ServiceProcess], int]:
    engine_port = free_port()
    engine = scripted_engine_process(engine_port, workdir, model, [REPLY]).start()
    gateways = {}
    for mode in MODES:
        gateways[mode] = gateway_process(servers, f"bench-trace-{uuid.uuid4().hex[:6]}", [f"127.0.0.1:{engine_port}"],
                                         model, free_port(), workdir / f"state-{mode}", workdir / f"gateway-{mode}.log",
                                         ["--prompt-length", "16384", "--response-length", "512",
                                          "--tracing", mode]).start()
    return engine, gateways, engine_port


def main() -> dict:
    with tempfile.TemporaryDirectory(prefix="trajbus-bench-tracing-") as name:
        workdir, broker = Path(name), None
        servers = os.environ.get("TRAJBUS_BOOTSTRAP_SERVERS")
        processes: list[ServiceProcess] = []
        try:
            if not servers:
                broker = EmbeddedKafka(state_dir=workdir / "broker")
                servers = broker.start().bootstrap_servers
            model = tiny_model.build()
            turns = conversation()
            prompts, _ = engine_prompts(model, turns)
            engine, gateways, engine_port = start(workdir, servers, model)
            processes = [engine, *gateways.values()]
            wait_http(f"http://127.0.0.1:{engine_port}/health", 120, engine)
            urls = {mode: f"http://127.0.0.1:{g.args[g.args.index('--port') + 1]}" for mode, g in gateways.items()}
            for mode, url in urls.items():
                wait_http(f"{url}/ready", 120, gateways[mode])
            meters = {mode: CpuMeter({"gateway": g.pid}) for mode, g in gateways.items()}
            print(f"\ntracing: {AGENTS} agents, {TURNS}-turn conversations to {len(prompts[-1])} prompt tokens, "
                  f"{len(REPLY)}-token replies; --tracing off and kafka alternating, {ROUNDS} phases each")
            result = summary(asyncio.run(measure(f"127.0.0.1:{engine_port}", urls, meters, turns, prompts)))
        finally:
            for process in reversed(processes):
                process.stop()
            if broker is not None:
                broker.stop()
    report(result)
    return result


def report(result: dict) -> None:
    modes = result["modes"]
    print_table(["--tracing", "gateway CPU ms/call (median of phases)", "phases", "p50 ms", "req/s"],
                [[mode, f"{m['cpu_ms_per_call']:.2f}", " ".join(f"{p['cpu_ms_per_call']:.2f}" for p in m["phases"]),
                  f"{m['p50_ms']:.1f}", f"{m['rps']:.0f}"] for mode, m in modes.items()])
    print_table(["target", "bound", "measured", "met"],
                [["gateway CPU per call, tracing kafka / off", f"<= {TARGET_RATIO}x",
                  f"{result['ratio_kafka_to_off']:.3f}x", "yes" if result["met"] else "MISSED"]])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tracing.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
