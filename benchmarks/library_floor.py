"""The libraries' floor: the least CPU a gateway call can cost on this machine with the gateway's own libraries.

A stand-in gateway with no trajbus code on the call's path, measured in the same run as the real one
(``gateway_bench``), so "<= 2 ms per call" can be read against what the parts underneath cost here. Per
call it does only what no gateway of this design can skip: the agent's request read and parsed (uvicorn
with httptools and uvloop, Starlette, orjson), the engine called with the turn's prompt ids, streamed at
the gateway's default ``--engine-stream-interval`` and parsed event by event (aiohttp, orjson), one record
of the new tokens and their log-probs acknowledged by Kafka (confluent-kafka, ``acks=all``, the gateway's
producer settings, delivery reports served by a poll thread), and a small JSON answer; Python's collector
is set as the gateway sets it (``infra.collector``). It leaves out what trajbus adds: tokenizing the new
messages, checking the request, the trajectory's state on disk, the Step's checks and prefix encoding,
metrics.

Run as ``python -m benchmarks.library_floor --port P --engine HOST:PORT --bootstrap-servers S --prompts F``
(``floor_process``); it answers ``/init_trajectory`` and ``{base_url}/chat/completions`` as the gateway
does, so the benchmark drives both with the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import threading
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from trajbus.gateway.config import GatewaySettings
from trajbus.infra.clients import acked_producer
from trajbus.infra.collector import tune_for_serving
from trajbus.infra.topics import TopicSpec, ensure_topics
from trajbus.pipelines.processes import ServiceProcess

TOPIC = "bench-library-floor"
NEW_PROMPT_TOKENS = 500
"""Prompt ids a record carries beside the reply: about what a turn's new message adds (the gateway
writes a step as a reference to its trajectory's previous one plus the new tokens)."""
STREAM_INTERVAL = next(f.default for f in dataclasses.fields(GatewaySettings) if f.name == "engine_stream_interval")
PRODUCER_SETTINGS = {"linger.ms": 0, "max.in.flight.requests.per.connection": 1, "compression.type": "lz4"}
"""The gateway's ``StepProducer`` settings that bear on a call's cost."""


def _turn(messages: list[Any]) -> int:
    """The turn a conversation is at: a system message, then a user message and a reply per turn."""
    return max(0, (len(messages) - 2) // 2)


class FloorGateway:
    """The stand-in's one route and the clients it owns (engine session, producer and its poll thread)."""

    def __init__(self, port: int, engine: str, bootstrap_servers: str, prompts: list[list[int]]) -> None:
        self.port, self.engine, self.prompts = port, engine, prompts
        self.producer = acked_producer(bootstrap_servers, PRODUCER_SETTINGS)
        self.session: aiohttp.ClientSession | None = None
        self._stopped = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="floor-delivery", daemon=True)

    def _poll(self) -> None:
        while not self._stopped.is_set():
            self.producer.poll(0.1)

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
        self._poller.start()
        try:
            yield
        finally:
            await self.session.close()
            self._stopped.set()
            self._poller.join()
            self.producer.flush(10)

    async def init_trajectory(self, _request: Request) -> Response:
        return Response(orjson.dumps({"base_url": f"http://127.0.0.1:{self.port}/t/p/v1"}),
                        media_type="application/json")

    async def chat(self, request: Request) -> Response:
        messages = orjson.loads(await request.body())["messages"]
        prompt = self.prompts[min(_turn(messages), len(self.prompts) - 1)]
        body = orjson.dumps({"prompt": prompt, "max_tokens": 512, "logprobs": 0, "return_tokens_as_token_ids": True,
                             "stream": True, "stream_interval": STREAM_INTERVAL})
        tokens, logprobs = [], []
        async with self.session.post(f"http://{self.engine}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"}) as answer:
            async for line in answer.content:
                if line.startswith(b"data: {"):
                    choice = orjson.loads(line[6:])["choices"][0]
                    tokens += choice["logprobs"]["tokens"]
                    logprobs += choice["logprobs"]["token_logprobs"]
        ids = [int(token.rpartition(":")[2]) for token in tokens]
        await self._acknowledged(orjson.dumps({"prompt_ids": prompt[-NEW_PROMPT_TOKENS:], "response_ids": ids,
                                               "rollout_log_probs": logprobs}))
        return Response(orjson.dumps({"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": f"{len(ids)} tokens"}, "finish_reason": "stop"}]}),
            media_type="application/json")

    async def _acknowledged(self, record: bytes) -> None:
        loop = asyncio.get_running_loop()
        settled = loop.create_future()

        def delivered(error: Any, _message: Any) -> None:
            loop.call_soon_threadsafe(settled.set_result, error)

        self.producer.produce(TOPIC, key=b"floor", value=record, on_delivery=delivered)
        error = await settled
        if error is not None:
            raise RuntimeError(f"not acknowledged: {error}")

    def app(self) -> Starlette:
        async def ready(_request: Request) -> Response:
            return Response(b"ok")

        return Starlette(routes=[Route("/ready", ready),
                                 Route("/init_trajectory", self.init_trajectory, methods=["POST"]),
                                 Route("/t/p/v1/chat/completions", self.chat, methods=["POST"])],
                         lifespan=self.lifespan)


def floor_process(port: int, engine: str, bootstrap_servers: str, prompts_file: Path, log_file: Path
                  ) -> ServiceProcess:
    """The stand-in as a child process (not yet started); ready when ``/ready`` answers."""
    return ServiceProcess(["--port", str(port), "--engine", engine, "--bootstrap-servers", bootstrap_servers,
                           "--prompts", str(prompts_file)], log_file, module="benchmarks.library_floor")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.library_floor", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", required=True, help="HOST:PORT of an engine's /v1/completions")
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of each turn's prompt ids")
    args = parser.parse_args(argv)
    ensure_topics(args.bootstrap_servers, [TopicSpec(TOPIC, 1)])
    floor = FloorGateway(args.port, args.engine, args.bootstrap_servers, orjson.loads(args.prompts.read_bytes()))
    app = floor.app()
    tune_for_serving()  # as the gateway does: the floor pays no collector time the gateway does not
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
