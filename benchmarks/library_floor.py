"""The libraries' floor: the least CPU a gateway call can cost on this machine with the gateway's own libraries.

A stand-in gateway with no trajbus code on the call's path but the delivery plumbing, measured in the same run
as the real one (``gateway_bench``), so "<= 2 ms per call" can be read against what the parts underneath cost
here. Per call it does only what no gateway of this design can skip: the agent's request read and parsed
(uvicorn with httptools and uvloop, Starlette, orjson), the turn's new message tokenized by the model's
tokenizer (Hugging Face ``tokenizers``, called directly: a token-exact gateway cannot send the engine ids it
has not made), the engine called with the turn's prompt ids, streamed
at the gateway's default ``--engine-stream-interval`` and parsed event by event (aiohttp, orjson), one record
of the new tokens and their log-probs acknowledged by Kafka (confluent-kafka, ``acks=all``, the step
producer's settings, its delivery reports served by trajbus's ``Poller`` as the gateway's are), and a small
JSON answer; it runs on the gateways' C allocator (the C library's, or mimalloc preloaded under
``TRAJBUS_GATEWAY_ALLOCATOR=mimalloc``: ``infra.allocator``), and Python's collector
has the gateway's thresholds and frozen startup (``infra.collector``; the gateway
also paces its collections while calls are in flight, the floor does not). It leaves out what
trajbus adds: the chat template, checking the request, the trajectory's state on disk, the Step's
checks and prefix encoding, metrics.

Run as ``python -m benchmarks.library_floor --port P --engine HOST:PORT --bootstrap-servers S --prompts F
--tokenizer DIR``
(``floor_process``); it answers ``/init_trajectory`` and ``{base_url}/chat/completions`` as the gateway
does, so the benchmark drives both with the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tokenizers import Tokenizer

from trajbus.gateway.config import ENV_PREFIX, GatewaySettings
from trajbus.infra.allocator import MIMALLOC, preloaded
from trajbus.infra.clients import acked_producer
from trajbus.infra.collector import tune_for_serving
from trajbus.infra.declared import env_var
from trajbus.infra.topics import TopicSpec, ensure_topics
from trajbus.pipelines.processes import ServiceProcess
from trajbus.streams.client.delivery import Acks, DeliveryError, Poller, resolve
from trajbus.streams.client.producer import STEP_PRODUCER_SETTINGS

TOPIC = "bench-library-floor"
STREAM_INTERVAL = next(f.default for f in dataclasses.fields(GatewaySettings) if f.name == "engine_stream_interval")


def _turn(messages: list[Any]) -> int:
    """The turn a conversation is at: a system message, then a user message and a reply per turn."""
    return max(0, (len(messages) - 2) // 2)


class FloorGateway:
    """The stand-in's one route and the clients it owns (engine session, producer and its delivery poller)."""

    def __init__(self, port: int, engine: str, bootstrap_servers: str, prompts: list[list[int]],
                 tokenizer: Tokenizer) -> None:
        self.port, self.engine, self.prompts, self.tokenizer = port, engine, prompts, tokenizer
        self.producer = acked_producer(bootstrap_servers, STEP_PRODUCER_SETTINGS)
        self.poller = Poller(self.producer)
        self.session: aiohttp.ClientSession | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            yield
        finally:
            await self.session.close()
            self.poller.stop()
            self.producer.flush(10)

    async def init_trajectory(self, _request: Request) -> Response:
        return Response(orjson.dumps({"base_url": f"http://127.0.0.1:{self.port}/t/p/v1"}),
                        media_type="application/json")

    async def chat(self, request: Request) -> Response:
        messages = orjson.loads(await request.body())["messages"]
        new_ids = self.tokenizer.encode(messages[-1]["content"], add_special_tokens=False).ids
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
        await self._acknowledged(orjson.dumps({"prompt_ids": new_ids, "response_ids": ids,
                                               "rollout_log_probs": logprobs}))
        return Response(orjson.dumps({"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": f"{len(ids)} tokens"}, "finish_reason": "stop"}]}),
            media_type="application/json")

    async def _acknowledged(self, record: bytes) -> None:
        """One produce, awaited as ``RecordSender.publish_async`` awaits a call's records."""
        loop = asyncio.get_running_loop()
        settled = loop.create_future()
        acks = Acks(1, partial(loop.call_soon_threadsafe, resolve, settled))
        self.poller.track(acks)
        self.producer.produce(TOPIC, key=b"floor", value=record, on_delivery=acks)
        await settled
        if acks.errors:
            raise DeliveryError(f"not acknowledged: {acks.errors[0].str()}")

    def app(self) -> Starlette:
        async def ready(_request: Request) -> Response:
            return Response(b"ok")

        return Starlette(routes=[Route("/ready", ready),
                                 Route("/init_trajectory", self.init_trajectory, methods=["POST"]),
                                 Route("/t/p/v1/chat/completions", self.chat, methods=["POST"])],
                         lifespan=self.lifespan)


def floor_process(port: int, engine: str, bootstrap_servers: str, prompts_file: Path, model_dir: Path,
                  log_file: Path) -> ServiceProcess:
    """The stand-in as a child process (not yet started); ready when ``/ready`` answers."""
    return ServiceProcess(["--port", str(port), "--engine", engine, "--bootstrap-servers", bootstrap_servers,
                           "--prompts", str(prompts_file), "--tokenizer", str(model_dir)], log_file,
                          env=preloaded(os.environ, os.environ.get(env_var(ENV_PREFIX, "allocator")) == MIMALLOC),
                          module="benchmarks.library_floor")  # the gateways' allocator (TRAJBUS_GATEWAY_ALLOCATOR)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.library_floor", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", required=True, help="HOST:PORT of an engine's /v1/completions")
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of each turn's prompt ids")
    parser.add_argument("--tokenizer", type=Path, required=True, help="the model's directory (its tokenizer.json)")
    args = parser.parse_args(argv)
    ensure_topics(args.bootstrap_servers, [TopicSpec(TOPIC, 1)])
    floor = FloorGateway(args.port, args.engine, args.bootstrap_servers, orjson.loads(args.prompts.read_bytes()),
                         Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")))
    app = floor.app()
    tune_for_serving()  # as the gateway does: the floor pays no collector time the gateway does not
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
