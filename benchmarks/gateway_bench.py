"""The gateway against calling the inference server directly, in the same run.

At 1, 32 and 256 concurrent agents, every agent sends chat completions one
after another (same conversation, 8 generated tokens with ``ignore_eos`` so
both paths generate the same amount): once straight to the local inference
server's ``/v1/chat/completions`` (baseline), once through the gateway's
black-box ``base_url`` (chat template + engine call + Step acknowledged by
Kafka). Reports latency p50/p99, requests/s, the gateway's added latency and
its throughput ratio to the baseline.

Uses TRAJBUS_BOOTSTRAP_SERVERS when set, else a throw-away embedded broker.
Prints a table and writes benchmarks/results/gateway.json.
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

import httpx

from benchmarks.assembly_bench import RESULTS, percentile
from infra import tiny_model
from infra.kafka_broker import EmbeddedKafka
from pipelines.processes import free_port, gateway_process, inference_server_process, wait_http

MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]
BODY = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
LEVELS = ((1, 40), (32, 256), (256, 512))  # (concurrent agents, requests in total)


async def run_agents(client: httpx.AsyncClient, urls: list[str], requests: int) -> tuple[list[float], float]:
    """Each URL is one agent calling in a loop; returns per-request latencies and the wall time."""
    latencies: list[float] = []
    per_agent = max(1, requests // len(urls))

    async def agent(url: str) -> None:
        for _ in range(per_agent):
            started = time.perf_counter()
            response = await client.post(url, json=BODY)
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(agent(url) for url in urls))
    return latencies, time.perf_counter() - started


async def measure(server: str, gateway: str) -> list[dict]:
    rows = []
    limits = httpx.Limits(max_connections=600, max_keepalive_connections=600)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await run_agents(client, [f"http://{server}/v1/chat/completions"], 8)  # warm-up both paths
        for agents, requests in LEVELS:
            direct_urls = [f"http://{server}/v1/chat/completions"] * agents
            trajectories = [(await client.post(f"{gateway}/init_trajectory", json={})).json() for _ in range(agents)]
            gateway_urls = [f"{t['base_url']}/chat/completions" for t in trajectories]
            if agents == 1:
                await run_agents(client, gateway_urls, 8)
            direct, direct_s = await run_agents(client, direct_urls, requests)
            via, via_s = await run_agents(client, gateway_urls, requests)
            row = {"agents": agents, "requests": len(direct),
                   "direct_p50_ms": 1000 * statistics.median(direct), "direct_p99_ms": 1000 * percentile(direct, 0.99),
                   "gateway_p50_ms": 1000 * statistics.median(via), "gateway_p99_ms": 1000 * percentile(via, 0.99),
                   "direct_rps": len(direct) / direct_s, "gateway_rps": len(via) / via_s}
            row["added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
            row["added_p99_ms"] = row["gateway_p99_ms"] - row["direct_p99_ms"]
            row["throughput_ratio"] = row["gateway_rps"] / row["direct_rps"]
            rows.append(row)
            print(f"  {agents} agents done: direct {row['direct_rps']:.0f} req/s, "
                  f"gateway {row['gateway_rps']:.0f} req/s", flush=True)
    return rows


def main() -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-bench-gateway-"))
    broker = None
    bootstrap = os.environ.get("TRAJBUS_BOOTSTRAP_SERVERS")
    processes = []
    try:
        if not bootstrap:
            broker = EmbeddedKafka(state_dir=workdir / "broker")
            bootstrap = broker.start().bootstrap_servers
        model = tiny_model.build()
        server_port, gateway_port = free_port(), free_port()
        server = inference_server_process(server_port, workdir / "server.log", model).start()
        processes.append(server)
        gateway = gateway_process(bootstrap, f"bench-{uuid.uuid4().hex[:6]}", [f"127.0.0.1:{server_port}"], model,
                                  gateway_port, workdir / "gateway-state", workdir / "gateway.log").start()
        processes.append(gateway)
        wait_http(f"http://127.0.0.1:{server_port}/health", 120, server)
        wait_http(f"http://127.0.0.1:{gateway_port}/ready", 120, gateway)
        print("\ngateway: chat completions of 8 tokens, direct to the inference server vs through the gateway")
        rows = asyncio.run(measure(f"127.0.0.1:{server_port}", f"http://127.0.0.1:{gateway_port}"))
    finally:
        for process in reversed(processes):
            process.stop()
        if broker is not None:
            broker.stop()

    print(f"{'agents':>6} {'requests':>8} | {'direct p50':>10} {'p99':>7} {'req/s':>7} | "
          f"{'gateway p50':>11} {'p99':>7} {'req/s':>7} | {'added p50':>9} {'p99':>7} {'ratio':>6}")
    for r in rows:
        print(f"{r['agents']:>6} {r['requests']:>8} | {r['direct_p50_ms']:>8.1f}ms {r['direct_p99_ms']:>5.0f}ms "
              f"{r['direct_rps']:>7.1f} | {r['gateway_p50_ms']:>9.1f}ms {r['gateway_p99_ms']:>5.0f}ms "
              f"{r['gateway_rps']:>7.1f} | {r['added_p50_ms']:>7.1f}ms {r['added_p99_ms']:>5.0f}ms "
              f"{r['throughput_ratio']:>5.2f}x")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway.json").write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
