"""Weight updates while agents generate: cut-and-continue against holding the update until generations end.

A reduction of the demo's training loop (``pipelines.demo.train``) with the scripted
engine at realistic sizes: ``--agents`` agents (16) each run one-call trajectories
through the gateway, the reply ``--tokens`` tokens long (2000) and sampled at
``--token-delay`` seconds a token (2 ms: a 4 s generation), every agent its own
prompt. The stream worker assembles the groups; the trainer fetches
``--groups-per-step`` groups, trains ``--train-seconds`` (a sleep standing for the
GPU step) and updates the weights through the gateway with
``PolicyVersionPublisher.update`` (pause, load the scripted weights, publish,
resume), ``--updates`` times. Two runs, one after the other on the same broker:

- ``drain`` (the baseline): the update waits until the generations in flight end;
  new calls are held meanwhile (what holding the update back costs);
- ``cut``: generations in flight are cut at the engine and continue under the new
  weights after the resume.

Per run: the trainer's wait per update (pause to resume), the generations cut,
the tokens the engine sampled that no agent received (thrown away), the tokens
kept at cuts (what an engine that drops a cut generation would have thrown away),
and the tokens delivered per second.

What streaming from the engine costs the gateway: to cut a generation, the gateway
reads every call as a stream, also for a client that asked for one JSON answer
(in events of ``--engine-stream-interval`` tokens). Second table: the gateway's CPU
per non-streaming call (300-token replies of an instant scripted engine, 8 calls at
once, ``benchmarks.cpu_meter``) with
``--engine-streaming always`` (the default) against ``when-asked`` (the engine's one
JSON answer, which an update cannot cut): a gateway of each on one engine, three phases
of each, alternating, medians compared.

Prints two tables and the targets with their figures; writes benchmarks/results/update.json. Uses
TRAJBUS_BOOTSTRAP_SERVERS when set, else a throw-away embedded broker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import aiohttp
import httpx

from benchmarks.assembly_bench import RESULTS
from benchmarks.cpu_meter import CpuMeter
from benchmarks.targets import Target, print_targets
from trajbus.consumers import BatchConsumer
from trajbus.infra import tiny_model
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.pipelines.processes import free_port, gateway_process, scripted_engine_process, wait_http, worker_process
from trajbus.pipelines.tables import print_table
from trajbus.streams.client.policy import PolicyVersionPublisher
from trajbus.streams.client.producer import StepProducer

SENTENCE = "Read the failing test, found the off-by-one in the parser, patched it and re-ran the suite. "
MODES = ("drain", "cut")


class Agents:
    """``count`` agents on one event loop in a thread: init, one chat call (held while paused), complete."""

    def __init__(self, gateway: str, count: int) -> None:
        self.gateway, self.count = gateway, count
        self.tokens = self.calls = self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="agents")

    async def _agent(self, client: aiohttp.ClientSession, index: int) -> None:
        messages = [{"role": "user", "content": f"Agent {index}: fix the parser."}]
        while not self._stop.is_set():
            async with client.post(f"{self.gateway}/init_trajectory",
                                   json={"prompt_uid": uuid.uuid4().hex, "n_rollouts": 1}) as response:
                base_url = (await response.json())["base_url"]
            async with client.post(f"{base_url}/chat/completions", params={"wait": "120"},
                                   json={"model": "bench", "messages": messages}) as response:
                answer = await response.json()
            if response.status != 200:
                self.errors += 1
                continue
            self.tokens += answer["usage"]["completion_tokens"]
            self.calls += 1
            async with client.post(f"{base_url}/complete_trajectory", json={"reward": 1.0}) as response:
                await response.read()

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as client:
            await asyncio.gather(*(self._agent(client, i) for i in range(self.count)))

    def start(self) -> "Agents":
        self._thread.start()
        return self

    def stop(self) -> None:
        """No new calls; the calls in flight end (so every token sampled has reached an agent or was lost)."""
        self._stop.set()
        self._thread.join(600)


def counter(gateway: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{gateway}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def measure(mode: str, servers: str, workdir: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    prefix = f"bench-update-{mode}-{uuid.uuid4().hex[:6]}"
    with StepProducer(servers, prefix=prefix) as producer:
        producer.provision("train")
    reply = (SENTENCE * (args.tokens // len(SENTENCE) + 1))[:args.tokens - 1]  # + EOS: --tokens ids
    engine_port, gateway_port = free_port(), free_port()
    engine = scripted_engine_process(engine_port, workdir, model_dir, [{"text": reply, "token_delay": args.token_delay}],
                                     workers=args.agents + 4).start()
    services = [engine]
    try:
        services.append(worker_process(servers, prefix, workdir / f"worker-{mode}.log", n_rollouts=1).start())
        gateway = gateway_process(servers, prefix, [f"127.0.0.1:{engine_port}"], model_dir, gateway_port,
                                  workdir / f"state-{mode}", workdir / f"gateway-{mode}.log",
                                  ["--response-length", str(args.tokens), "--max-pause", "300"]).start()
        services.append(gateway)
        engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
        wait_http(f"{engine_url}/health", 120, engine)
        wait_http(f"{gateway_url}/ready", 120, gateway)
        return train(mode, servers, prefix, engine_url, gateway_url, model_dir, args)
    finally:
        for service in reversed(services):
            service.stop()


def train(mode: str, servers: str, prefix: str, engine_url: str, gateway_url: str, model_dir: Path,
          args: argparse.Namespace) -> dict:
    """The trainer's loop: fetch a batch of groups, train, update through the gateway; agents meanwhile."""
    def load() -> None:
        httpx.post(f"{engine_url}/update_weights_from_disk", json={"model_path": str(model_dir)},
                   timeout=60).raise_for_status()

    updates = []
    with PolicyVersionPublisher(servers, prefix=prefix) as publisher:
        publisher.publish(0)
        agents = Agents(gateway_url, args.agents).start()
        started = time.monotonic()
        try:
            with BatchConsumer("train", servers, prefix=prefix) as consumer:
                for version in range(1, args.updates + 1):
                    for _ in range(args.groups_per_step):
                        if consumer.fetch_batch(timeout=120) is None:
                            raise RuntimeError("no group within 120 s")
                    time.sleep(args.train_seconds)  # the GPU step
                    report = publisher.update(version, load=load, gateways=[gateway_url], drain=mode == "drain")
                    updates.append({"version": version, "wait_s": report.paused_seconds,
                                    "cut": sum(report.cut.values()), "load_s": report.load_seconds})
        finally:
            agents.stop()
        wall = time.monotonic() - started
    sampled = httpx.get(f"{engine_url}/get_model_info").json()["sampled_tokens"]
    return {"mode": mode, "updates": updates, "calls": agents.calls, "errors": agents.errors,
            "tokens_delivered": agents.tokens, "tokens_sampled": sampled, "thrown_away": sampled - agents.tokens,
            "kept_at_cuts": counter(gateway_url, "trajbus_gateway_cut_tokens_total"),
            "continued": counter(gateway_url, 'trajbus_gateway_generations_total{event="continued"}'),
            "wall_s": wall, "tokens_per_s": agents.tokens / wall}


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.update_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per generation (EOS included)")
    parser.add_argument("--token-delay", type=float, default=0.002, help="seconds the engine takes per token")
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--train-seconds", type=float, default=1.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    with tempfile.TemporaryDirectory(prefix="trajbus-update-") as workdir:
        broker = None
        servers = os.environ.get("TRAJBUS_BOOTSTRAP_SERVERS")
        try:
            if servers is None:
                broker = EmbeddedKafka(state_dir=Path(workdir) / "broker")
                servers = broker.start().bootstrap_servers
            runs = [measure(mode, servers, Path(workdir), tiny_model.build(), args) for mode in MODES]
            costs = stream_costs(servers, Path(workdir), tiny_model.build())
        finally:
            if broker is not None:
                broker.stop()
    report(runs, costs, args)


STREAMING = ("when-asked", "always")
COST_CALLS, COST_WARMUP, COST_CONCURRENCY, COST_TOKENS, COST_PHASES = 200, 40, 8, 300, 3
"""Calls per phase; phases per gateway, alternating (the median compared), so both modes meet the
machine in the same states."""


async def _calls(gateway: str, count: int, concurrency: int) -> None:
    """``count`` one-call trajectories, ``concurrency`` at once, each answer read whole."""
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as client:
        async def one() -> None:
            async with limit:
                async with client.post(f"{gateway}/init_trajectory", json={"prompt_uid": uuid.uuid4().hex,
                                                                            "n_rollouts": 1}) as response:
                    base_url = (await response.json())["base_url"]
                async with client.post(f"{base_url}/chat/completions",
                                       json={"messages": [{"role": "user", "content": "Hi."}]}) as response:
                    if response.status != 200:
                        raise RuntimeError(f"{response.status}: {await response.text()}")
                    await response.read()

        await asyncio.gather(*(one() for _ in range(count)))


def stream_costs(servers: str, workdir: Path, model_dir: Path) -> list[dict]:
    """The gateway's CPU per non-streaming call with each ``--engine-streaming`` mode: one engine, a gateway
    per mode, ``COST_PHASES`` phases of each, alternating; medians."""
    engine_port = free_port()
    reply = (SENTENCE * (COST_TOKENS // len(SENTENCE) + 1))[:COST_TOKENS - 1]  # + EOS
    engine = scripted_engine_process(engine_port, workdir, model_dir, [reply]).start()
    gateways = {}
    try:
        for streaming in STREAMING:
            prefix, port = f"bench-stream-{streaming}-{uuid.uuid4().hex[:6]}", free_port()
            with StepProducer(servers, prefix=prefix) as producer:
                producer.provision("train")
            gateways[streaming] = (f"http://127.0.0.1:{port}", gateway_process(
                servers, prefix, [f"127.0.0.1:{engine_port}"], model_dir, port, workdir / f"state-{streaming}",
                workdir / f"gateway-{streaming}.log", ["--engine-streaming", streaming]).start())
        wait_http(f"http://127.0.0.1:{engine_port}/health", 120, engine)
        phases: dict[str, list[tuple[float, float]]] = {streaming: [] for streaming in STREAMING}
        for url, gateway in gateways.values():
            wait_http(f"{url}/ready", 120, gateway)
            asyncio.run(_calls(url, COST_WARMUP, COST_CONCURRENCY))
        for _ in range(COST_PHASES):
            for streaming, (url, gateway) in gateways.items():
                meter = CpuMeter({"gateway": gateway.pid})
                before = meter.snapshot()
                asyncio.run(_calls(url, COST_CALLS, COST_CONCURRENCY))
                phase = meter.since(before)
                phases[streaming].append((1000 * phase.cpu_s["gateway"] / COST_CALLS, 1000 * phase.wall_s / COST_CALLS))
        return [{"engine_streaming": streaming, "calls": COST_CALLS * COST_PHASES, "reply_tokens": COST_TOKENS,
                 "phases_cpu_ms": [cpu for cpu, _ in phases[streaming]],
                 "gateway_cpu_ms_per_call": statistics.median(cpu for cpu, _ in phases[streaming]),
                 "wall_ms_per_call": statistics.median(wall for _, wall in phases[streaming])}
                for streaming in STREAMING]
    finally:
        for _, gateway in gateways.values():
            gateway.stop()
        engine.stop()


def report(runs: list[dict], costs: list[dict], args: argparse.Namespace) -> None:
    print(f"\nweight updates while {args.agents} agents generate {args.tokens}-token replies "
          f"({args.token_delay * 1000:g} ms a token), {args.updates} updates, {args.groups_per_step} groups a step")
    rows = []
    for run in runs:
        waits = [u["wait_s"] for u in run["updates"]]
        run["wait_mean_s"], run["wait_max_s"] = statistics.mean(waits), max(waits)
        rows.append([run["mode"], f"{run['wait_mean_s']:.3f}", f"{run['wait_max_s']:.3f}",
                     sum(u["cut"] for u in run["updates"]), f"{run['continued']:.0f}", run["tokens_sampled"],
                     run["tokens_delivered"], run["thrown_away"], f"{run['kept_at_cuts']:.0f}",
                     f"{run['tokens_per_s']:.0f}", run["errors"]])
    print_table(["update", "trainer wait/update s", "max s", "cut", "continued", "tokens sampled", "delivered",
                 "thrown away", "kept at cuts", "tokens/s", "errors"], rows)
    drain, cut = runs
    ratio = cut["wait_mean_s"] / drain["wait_mean_s"] if drain["wait_mean_s"] else float("nan")
    print(f"trainer wait per update, cut-and-continue / drain: {ratio:.3f}x")
    print(f"\nthe gateway's CPU per non-streaming call ({costs[0]['reply_tokens']}-token replies, instant engine, "
          f"{COST_CONCURRENCY} calls at once, {COST_PHASES} phases of {COST_CALLS} calls a mode, alternating)")
    print_table(["--engine-streaming", "gateway CPU ms/call (median)", "phases", "wall ms/call (median)"],
                [[c["engine_streaming"], f"{c['gateway_cpu_ms_per_call']:.2f}",
                  " ".join(f"{v:.2f}" for v in c["phases_cpu_ms"]), f"{c['wall_ms_per_call']:.2f}"] for c in costs])
    unstreamed, streamed = (c["gateway_cpu_ms_per_call"] for c in costs)
    cost_ratio = streamed / unstreamed
    errors = sum(run["errors"] for run in runs)
    targets = print_targets([
        Target("gateway CPU per non-streaming call, always / when-asked (medians)", "<= 1.2x",
               f"{cost_ratio:.3f}x ({streamed:.2f} vs {unstreamed:.2f} ms)", cost_ratio <= 1.2),
        Target("trainer wait per update, cut-and-continue / drain", "< 1.0x", f"{ratio:.3f}x", ratio < 1.0),
        Target("agent calls that failed, both runs", "0", str(errors), errors == 0),
    ], "Targets (scripted engine, this machine)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "update.json").write_text(json.dumps({"arguments": vars(args), "runs": runs, "wait_ratio": ratio,
                                                     "stream_cost": costs, "stream_cost_ratio": cost_ratio,
                                                     "targets": targets}, indent=2))


if __name__ == "__main__":
    main()
