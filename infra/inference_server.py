"""A local OpenAI/vLLM-compatible inference server around a real (tiny) causal LM.

Tests, benchmarks and the demo put it behind the gateway where production puts
vLLM. It speaks the subset of vLLM's API the gateway uses, with vLLM's
semantics: ``POST /v1/completions`` with a token-id prompt, ``n``,
``temperature`` (0 = greedy), ``top_p``, ``max_tokens``, ``stop``, ``seed``,
``ignore_eos``, ``logprobs`` (the sampled token's raw log-probability, as vLLM's
default ``raw_logprobs``), ``return_token_ids`` and
``return_tokens_as_token_ids``, and ``stream`` as server-sent events;
``POST /update_weights_from_disk`` loads a trainer's new weights (``GET
/get_model_info`` says from where and how many loads so far). A streaming client
that disconnects aborts its generation at the next token (how a gateway cuts a
generation for a weight update). The EOS
id is part of the returned ``token_ids`` (as in vLLM); text omits special
tokens and stop strings. ``POST /v1/chat/completions`` serves plain chat (the
baseline for gateway benchmarks). Requests run one at a time on a generation
thread; seeded requests are reproducible.

Run: ``python -m trajbus.infra.inference_server --port 8000`` (builds the tiny model on
first use) or ``--model-dir`` for any Hugging Face causal LM directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from trajbus.infra.declared import add_flags, resolve, setting
from trajbus.infra.engine_requests import (Aborted, EngineSample, RequestError, SamplingParams, TokenBatches,
                                           sampling_params)

log = logging.getLogger("trajbus.inference_server")
ENV_PREFIX = "TRAJBUS_INFERENCE_"


@dataclass
class InferenceServerSettings:
    """The server's settings: a flag each (``python -m trajbus.infra.inference_server`` and
    ``trajbus inference-server`` share them) and a ``TRAJBUS_INFERENCE_*`` variable."""

    model_dir: Path | None = setting(None, help="a Hugging Face causal LM directory (off: the tiny chat model)")
    served_model_name: str = setting("trajbus-tiny-chat", help="model name in responses")
    host: str = setting("127.0.0.1", help="interface to listen on")
    port: int = setting(8000, help="port to listen on")
    device: str | None = setting(None, help="torch device (off: cuda when available, else cpu)")


class Engine:
    """Token-by-token sampling with a KV cache; one request at a time (a single generation thread)."""

    def __init__(self, model_dir: Path, device: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # a server's stderr is its log: no "Loading weights" bar
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).to(self.device).eval()
        self.loads = 1
        self.sampled_tokens = 0
        self.eos_ids = {self.tokenizer.eos_token_id}
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")

    def load_weights(self, model_dir: Path) -> float:
        """Swap in the weights at ``model_dir``; runs on the generation thread, so never mid-request."""
        from transformers import AutoModelForCausalLM

        started = time.monotonic()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).to(self.device).eval()
        self.loads += 1
        log.info("weights loaded from %s (load %d)", model_dir, self.loads)
        return time.monotonic() - started

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def sample(self, prompt_ids: list[int], params: SamplingParams, generator,
               on_token: Callable[[int, float, str], None] | None = None,
               aborted: threading.Event | None = None) -> EngineSample:
        """One completion; ``on_token(id, logprob, text_so_far)`` after every sampled token. ``aborted`` (set
        when the client went away) is not read here: ``on_token`` raises once it is set, and runs every token."""
        import torch

        if len(prompt_ids) + params.max_tokens > self.max_length:
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                               f"the model's {self.max_length} positions")
        ids: list[int] = []
        logprobs: list[float] = []
        text, finish = "", "length"
        inputs = torch.tensor([prompt_ids], device=self.device)
        past = None
        with torch.no_grad():
            for _ in range(params.max_tokens):
                out = self.model(input_ids=inputs, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                raw = torch.log_softmax(logits, dim=-1)
                if params.ignore_eos:
                    logits[list(self.eos_ids)] = float("-inf")
                token = self._choose(logits, params, generator)
                ids.append(token)
                self.sampled_tokens += 1
                logprobs.append(float(raw[token]))
                text = self._text(ids)
                hit = next((s for s in params.stop if s in text), None)
                if hit is not None:
                    text, finish = text[:text.index(hit)], "stop"
                if on_token is not None:
                    on_token(token, logprobs[-1], text)
                if hit is not None or token in self.eos_ids:
                    finish = "stop"
                    break
                inputs = torch.tensor([[token]], device=self.device)
        return EngineSample(ids, logprobs, text, finish)

    @staticmethod
    def _choose(logits, params: SamplingParams, generator) -> int:
        import torch

        if params.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs.cpu(), 1, generator=generator))

    def generator(self, seed: int | None):
        import torch

        g = torch.Generator()
        g.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:6], "big"))
        return g


# -- the HTTP app -------------------------------------------------------------------

def create_app(engine: Engine, model_name: str):
    """The HTTP app: each route is a method of one ``ServedModel`` (the engine and its name)."""
    served = ServedModel(engine, model_name)
    app = FastAPI(title="trajbus local inference server")
    app.add_exception_handler(RequestError, _bad_request)
    app.get("/health")(served.health)
    app.get("/v1/models")(served.models)
    app.post("/v1/completions")(served.completions)
    app.post("/update_weights_from_disk")(served.update_weights_from_disk)
    app.get("/get_model_info")(served.model_info)
    app.post("/v1/chat/completions")(served.chat)
    return app


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": status}}, status)


async def _bad_request(_request: Request, exc: RequestError) -> JSONResponse:
    return _error(400, str(exc))


class ServedModel:
    """What the routes serve: the engine (one generation thread), the model's name and its vocabulary."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name
        self.vocabulary = len(engine.tokenizer)  # computed once: len() of a Hugging Face tokenizer walks its vocabulary

    async def health(self) -> dict:
        return {"status": "ok"}

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "trajbus",
                                            "max_model_len": self.engine.max_length}]}

    async def run_samples(self, prompt_ids: list[int], params: SamplingParams, n: int,
                          on_token: Callable[[int, int, float, str], None] | None = None,
                          aborted: threading.Event | None = None) -> list[EngineSample]:
        loop = asyncio.get_running_loop()
        engine = self.engine

        def token(i: int, t: int, lp: float, text: str) -> None:
            if aborted is not None and aborted.is_set():
                raise Aborted("the client went away")
            on_token(i, t, lp, text)

        def work() -> list[EngineSample]:
            generator = engine.generator(params.seed)
            return [engine.sample(prompt_ids, params, generator,
                                  None if on_token is None else (lambda t, lp, text, i=i: token(i, t, lp, text)),
                                  aborted)
                    for i in range(n)]

        return await loop.run_in_executor(engine.executor, work)

    def prompt_of(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < self.vocabulary for t in prompt):
            return prompt
        raise RequestError("prompt: must be a string or a non-empty list of valid token ids")

    def choice_extras(self, body: dict, sample: EngineSample) -> dict:
        extras: dict[str, Any] = {}
        if body.get("return_token_ids"):
            extras["token_ids"] = sample.token_ids
        if body.get("logprobs") is not None:
            as_ids = body.get("return_tokens_as_token_ids")
            extras["logprobs"] = {
                "tokens": [f"token_id:{t}" if as_ids else self.engine.tokenizer.convert_ids_to_tokens(t)
                           for t in sample.token_ids],
                "token_logprobs": sample.logprobs, "top_logprobs": None, "text_offset": None}
        return extras

    async def completions(self, request: Request):
        body = await _json_body(request)
        prompt_ids = self.prompt_of(body)
        params, n = sampling_params(body)
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        if body.get("stream"):
            return StreamingResponse(self._stream_completion(body, prompt_ids, params, n, rid, created),
                                     media_type="text/event-stream")
        samples = await self.run_samples(prompt_ids, params, n)
        choices = [{"index": i, "text": s.text, "finish_reason": s.finish_reason, "stop_reason": None,
                    "logprobs": None, **self.choice_extras(body, s),
                    **({"prompt_token_ids": prompt_ids} if body.get("return_token_ids") else {})}
                   for i, s in enumerate(samples)]
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": _usage(prompt_ids, samples)}

    async def _stream_completion(self, body: dict, prompt_ids: list[int], params: SamplingParams, n: int,
                                 rid: str, created: int) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        batches = TokenBatches(params.stream_interval, lambda batch: loop.call_soon_threadsafe(queue.put_nowait, batch))
        aborted = threading.Event()
        task = asyncio.ensure_future(self.run_samples(prompt_ids, params, n, batches.add, aborted))

        def ended(finished: asyncio.Future) -> None:
            finished.cancelled() or finished.exception()  # retrieved, also when aborted
            for batch in batches.rest():  # the generation's thread is done: what it held back, then the end
                queue.put_nowait(batch)
            queue.put_nowait(None)

        task.add_done_callback(ended)
        try:
            async for event in self._events(body, rid, created, params, n, queue, task):
                yield event
        finally:  # the client went away (or the stream ended): a generation still running stops
            aborted.set()

    async def _events(self, body: dict, rid: str, created: int, params: SamplingParams, n: int,
                      queue: asyncio.Queue, task: asyncio.Future) -> AsyncIterator[str]:
        model_name = self.model_name
        sent = [""] * n
        hold = max((len(s) for s in params.stop), default=1) - 1
        pending: dict[int, list[tuple[int, float]]] = {i: [] for i in range(n)}
        events = [0] * n
        while True:
            item = await queue.get()
            if item is None:
                break
            index, tokens, text = item
            pending[index] += tokens
            if events[index] and len(pending[index]) < params.stream_interval:
                continue  # vLLM's stream interval: the first event at once, then one per interval tokens
            visible = text[:len(text) - hold] if hold else text
            if visible.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
                continue
            delta = visible[len(sent[index]):] if visible.startswith(sent[index]) else ""
            sent[index] += delta
            yield _sse(_chunk(body, rid, created, model_name, index, delta, pending[index], None))
            pending[index] = []
            events[index] += 1
        samples = task.result() if not task.exception() else None
        if samples is None:
            yield _sse({"error": {"message": str(task.exception()), "type": "InternalServerError", "code": 500}})
        else:
            for index, sample in enumerate(samples):
                delta = sample.text[len(sent[index]):] if sample.text.startswith(sent[index]) else ""
                yield _sse(_chunk(body, rid, created, model_name, index, delta, pending[index],
                                  sample.finish_reason))
        yield "data: [DONE]\n\n"

    async def update_weights_from_disk(self, request: Request) -> dict:
        """Load new weights (a trainer's checkpoint) between two requests; SGLang's endpoint name."""
        engine = self.engine
        body = await _json_body(request)
        path = body.get("model_path") or str(engine.model_dir)
        if not Path(path, "config.json").is_file():
            raise RequestError(f"model_path: no model at {path!r}")
        loop = asyncio.get_running_loop()
        seconds = await loop.run_in_executor(engine.executor, engine.load_weights, Path(path))
        return {"success": True, "model_path": path, "seconds": round(seconds, 3), "loads": engine.loads}

    async def model_info(self) -> dict:
        """Which weights are served: ``loads`` counts the weight loads (1: the weights it started with);
        ``sampled_tokens``: every token sampled so far, delivered or not."""
        engine = self.engine
        return {"model_path": str(engine.model_dir), "loads": engine.loads, "sampled_tokens": engine.sampled_tokens}

    async def chat(self, request: Request):
        body = await _json_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages: must be a non-empty list")
        text = self.engine.tokenizer.apply_chat_template(messages, tools=body.get("tools"), tokenize=False,
                                                         add_generation_prompt=True)
        prompt_ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        params, n = sampling_params(body)
        samples = await self.run_samples(prompt_ids, params, n)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": s.text},
                             "finish_reason": s.finish_reason, "logprobs": None} for i, s in enumerate(samples)],
                "usage": _usage(prompt_ids, samples)}


async def _json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise RequestError("body: not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError("body: must be a JSON object")
    return body


def _usage(prompt_ids: list[int], samples: list[EngineSample]) -> dict:
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def _chunk(body: dict, rid: str, created: int, model: str, index: int, delta: str,
           tokens: list[tuple[int, float]], finish_reason: str | None) -> dict:
    choice: dict[str, Any] = {"index": index, "text": delta, "finish_reason": finish_reason, "logprobs": None}
    if body.get("return_token_ids"):
        choice["token_ids"] = [t for t, _ in tokens]
    if body.get("logprobs") is not None:
        choice["logprobs"] = {"tokens": [f"token_id:{t}" for t, _ in tokens],
                              "token_logprobs": [lp for _, lp in tokens], "top_logprobs": None, "text_offset": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def serve(settings: InferenceServerSettings) -> int:
    """Load the model (the tiny one unless ``model_dir``) and serve until SIGTERM/SIGINT."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from trajbus.infra import tiny_model

    model_dir = settings.model_dir or tiny_model.build()
    engine = Engine(model_dir, settings.device)
    log.info("serving %s from %s on %s (http://%s:%d)", settings.served_model_name, model_dir, engine.device,
             settings.host, settings.port)
    uvicorn.run(create_app(engine, settings.served_model_name), host=settings.host, port=settings.port,
                log_level="warning", log_config=None, timeout_graceful_shutdown=10)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trajbus.infra.inference_server",
                                     description=__doc__.split("\n")[0])
    add_flags(parser, InferenceServerSettings, ENV_PREFIX)
    args = parser.parse_args(argv)
    try:
        settings = InferenceServerSettings(**resolve(InferenceServerSettings, args, ENV_PREFIX))
    except ValueError as exc:
        parser.error(str(exc))
    return serve(settings)


if __name__ == "__main__":
    raise SystemExit(main())
