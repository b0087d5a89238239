"""An OpenAI/vLLM-compatible engine that answers from a script, instantly and token-exactly.

Two things need an engine whose output is known in advance: tests of token
consistency, where the sampled ids must be a non-canonical encoding of their
text (as real engines sample at temperature > 0: BPE has many encodings of one
string), and the gateway benchmark, where the engine must cost nothing so the
figure is the gateway's own. This engine serves the same HTTP API as
``infra.inference_server`` (it is that server's app around another engine): each
request gets the next reply of the script, encoded character by character and
ended by EOS, and every prompt it received can be appended to a JSON-lines file.
A reply may also be ``{"text": ..., "delay": seconds}`` (a slow call),
``{"text": ..., "token_delay": seconds}`` (a slow generation: that long before
each token, so a weight update can cut it mid-response; on a schedule from the call's start, so a
generation lasts its tokens x the delay even when many at once wake late; its thread wakes only when the
server hands tokens on, once a stream interval, so a thousand paced calls do not starve the host's cores)
or ``{"fail": message, "delay": seconds}`` (a call the engine fails with HTTP 500), so tests can script
an engine's faults. Two more misbehave as a broken engine or proxy would, to a
streaming request only (``Misbehaving``; meant for scripts served one call at a
time): ``{"text": ..., "unstreamed": "whole"}`` answers one ``application/json``
completion (ids and log-probs as asked), ``"unstreamed": "bare"`` one without
ids or log-probs, and ``{"text": ..., "break_after": N}`` ends the body cleanly
after N events (no ``finish_reason``, no ``[DONE]``). A reply may also carry
``"health_delay": seconds``: from the call that takes it on, ``GET /health``
waits that long before answering, as a busy engine's may, while calls are
answered as before (``0`` ends it). ``{"text": ..., "gate": path}`` holds the
call until that file exists, so a test can hold thousands of calls in flight
at once and then let them all go (with ``--workers`` as many as it holds).

A benchmark that must tell the engine's time from what is added on the way to it asks each call with its
own ``seed``: ``GET /timings`` answers, per seed, the seconds from the call's body read to its last byte
sent (the latest ``TIMINGS_KEPT``).

Weight updates are scripted too, deterministically: ``/update_weights_from_disk``
counts a load (``GET /get_model_info`` says how many), and every token's
log-probability names the load that sampled it (``log_prob(position, load)``),
so tokens sampled after a swap are identifiable. A generation whose client went
away mid-stream (cut) is remembered: a request whose prompt is that prompt plus
the first tokens of its reply continues the reply from there, as a model given
the prompt and a partial response would, instead of taking the next one.

Run: ``python -m trajbus.infra.scripted_engine --tokenizer-path DIR --replies replies.json --port 8000``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from starlette.responses import JSONResponse

from trajbus.infra.engine_requests import EngineSample, SamplingParams
from trajbus.infra.inference_server import create_app

log = logging.getLogger("trajbus.scripted_engine")


@dataclass
class ScriptedReply:
    text: str
    ids: list[int]
    delay: float = 0.0
    fail: str | None = None
    token_delay: float = 0.0
    pieces: list[str] | None = None
    """Each token's text, when they join to the reply's (streamed text then costs O(tokens), not O(tokens^2))."""
    unstreamed: str | None = None
    """To a streaming request: ``whole``, one JSON completion; ``bare``, one without ids or log-probs."""
    break_after: int | None = None
    """To a streaming request: the body ends after this many events, with no finish_reason and no [DONE]."""
    health_delay: float | None = None
    """From this reply on, seconds ``GET /health`` waits before answering (``None``: unchanged)."""
    gate: str | None = None
    """A file: the call is held until it exists."""


def log_prob(position: int, load: int = 1) -> float:
    """The log-probability of a reply's token at ``position``, sampled by weight load ``load``: varied
    (a real engine's are never constant) and deterministic, each load's distinct."""
    return -0.01 - 0.37 * ((position * 7919) % 13) / 13 - 0.001 * (load - 1)


def log_probs(count: int, start: int = 0, load: int = 1) -> list[float]:
    return [log_prob(k, load) for k in range(start, start + count)]


def noncanonical_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as one id per character (added tokens such as ``<tool_call>`` stay one id): a valid
    encoding of the text that the tokenizer's own BPE merges would not produce."""
    added = sorted(tokenizer.get_added_vocab().items(), key=lambda item: -len(item[0]))
    ids: list[int] = []
    position = 0
    while position < len(text):
        token = next(((t, i) for t, i in added if text.startswith(t, position)), None)
        if token is not None:
            ids.append(token[1])
            position += len(token[0])
            continue
        ids += tokenizer.encode(text[position], add_special_tokens=False)
        position += 1
    return ids


class ScriptedEngine:
    """The engine interface of ``infra.inference_server`` with replies from a script."""

    def __init__(self, tokenizer_path: Path, replies: list[str | dict[str, Any]], record: Path | None = None,
                 max_length: int = 1 << 20, workers: int = 1) -> None:
        from trajbus.infra.tokenizer_loading import load_tokenizer

        if not replies:
            raise ValueError("replies: the script needs at least one reply")
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.model_dir = tokenizer_path
        self.max_length = max_length
        self.loads = 1
        self.sampled_tokens = 0
        """Every token sampled, delivered or not (a benchmark compares it with what reached the agents)."""
        self._replies = [self._scripted(reply) for reply in replies]
        self._taken = 0
        """Replies taken so far; the next is ``_replies[_taken % len(_replies)]``."""
        self.health_delay = 0.0
        """Seconds ``GET /health`` waits before answering (``Misbehaving``), set by a reply's ``health_delay``."""
        self._record = record
        self._lock = threading.Lock()
        self._cut: list[tuple[list[int], ScriptedReply]] = []
        """Generations cut mid-stream: (prompt, reply), until a request continues one."""
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="scripted")
        self._gates: dict[str, threading.Event] = {}
        """Each gate file's opening, set by one watching thread (not every held call polling the file)."""

    def _scripted(self, reply: str | dict[str, Any]) -> ScriptedReply:
        if isinstance(reply, str):
            reply = {"text": reply}
        text = reply.get("text", "")
        ids = noncanonical_ids(self.tokenizer, text) + [self.tokenizer.eos_token_id]
        pieces = [self.tokenizer.decode([i], skip_special_tokens=True) for i in ids]
        if reply.get("unstreamed") not in (None, "whole", "bare"):
            raise ValueError(f"unstreamed: 'whole' or 'bare', not {reply['unstreamed']!r}")
        return ScriptedReply(text, ids, float(reply.get("delay", 0.0)), reply.get("fail"),
                             float(reply.get("token_delay", 0.0)), pieces if "".join(pieces) == text else None,
                             reply.get("unstreamed"), reply.get("break_after"),
                             None if reply.get("health_delay") is None else float(reply["health_delay"]),
                             reply.get("gate"))

    def upcoming(self) -> ScriptedReply:
        """The reply the next new request takes (``Misbehaving`` decides how to answer it before it is sampled)."""
        with self._lock:
            return self._replies[self._taken % len(self._replies)]

    def _next_reply(self) -> ScriptedReply:
        reply = self._replies[self._taken % len(self._replies)]
        self._taken += 1
        if reply.health_delay is not None:
            self.health_delay = reply.health_delay
        return reply

    def _opened(self, gate: str) -> threading.Event:
        """Set once ``gate`` exists (one thread watches each gate file until then)."""
        with self._lock:
            opened = self._gates.get(gate)
            if opened is None:
                opened = self._gates[gate] = threading.Event()

                def watch() -> None:
                    while not Path(gate).exists():
                        time.sleep(0.05)
                    opened.set()

                threading.Thread(target=watch, name="scripted-gate", daemon=True).start()
        return opened

    def generator(self, seed: int | None) -> None:
        return None

    def load_weights(self, model_dir: Path) -> float:
        """A scripted weight load: tokens sampled from now on carry the next load's log-probs."""
        with self._lock:
            self.loads += 1
        return 0.0

    def _continued(self, prompt_ids: list[int]) -> tuple[ScriptedReply, int] | None:
        """The cut generation this prompt continues (its prompt + the first tokens of its reply, at least
        one: the same prompt alone is a new request), and where."""
        for k, (prompt, reply) in enumerate(self._cut):
            done = len(prompt_ids) - len(prompt)
            if 0 < done <= len(reply.ids) and prompt_ids[:len(prompt)] == prompt \
                    and prompt_ids[len(prompt):] == reply.ids[:done]:
                del self._cut[k]
                return reply, done
        return None

    def sample(self, prompt_ids: list[int], params: SamplingParams, generator: None,
               on_token: Callable[[int, float, str], None] | None = None,
               aborted: threading.Event | None = None) -> EngineSample:
        """``aborted``: set when the client went away; a paced generation waiting for its next hand-off stops
        waiting, so its cut is known (and continued by the next request) at once."""
        with self._lock:
            reply, start = self._continued(prompt_ids) or (self._next_reply(), 0)
            if self._record is not None:
                with self._record.open("a") as out:
                    out.write(json.dumps({"prompt_ids": prompt_ids}) + "\n")
        time.sleep(reply.delay if not start else 0.0)  # the scripted engine's latency
        if reply.gate is not None:
            self._opened(reply.gate).wait()
        if reply.fail is not None:
            raise RuntimeError(reply.fail)
        ids, finish = reply.ids[start:start + params.max_tokens], "stop"
        if len(ids) < len(reply.ids) - start:
            finish = "length"
        text = reply.text if not start and finish == "stop" else self.tokenizer.decode(ids, skip_special_tokens=True)
        values: list[float] = []
        streamed = ""
        paced_from = time.monotonic()
        interval = params.stream_interval if on_token is not None else None
        for k, token in enumerate(ids):
            if reply.token_delay and _handed_on(k, len(ids), interval):
                # token k is due k + 1 delays after the start (a late wakeup does not delay the rest); the thread
                # wakes only when the server hands tokens on, as a GPU engine costs its host no wake-up a token
                due = max(0.0, paced_from + (k + 1) * reply.token_delay - time.monotonic())
                if aborted is None:
                    time.sleep(due)
                else:  # woken when the client goes away: on_token raises, and the cut is known at once
                    aborted.wait(due)
            values.append(log_prob(start + k, self.loads))  # the weights this token is sampled with
            with self._lock:  # several generations at once (--workers)
                self.sampled_tokens += 1
            if on_token is None:
                continue
            streamed = streamed + reply.pieces[start + k] if reply.pieces is not None else \
                self.tokenizer.decode(ids[:k + 1], skip_special_tokens=True)
            try:
                on_token(token, values[-1], streamed)
            except Exception:  # the client went away: a later request may continue this generation
                with self._lock:
                    self._cut.append((list(prompt_ids), reply))
                raise
        return EngineSample(list(ids), values, text, finish)


def _handed_on(k: int, count: int, interval: int | None) -> bool:
    """Whether the server hands token ``k`` of ``count`` on as it is sampled: the first and each ``interval``-th
    after it (``engine_requests.TokenBatches``), and the last; of a whole answer (``interval`` None) the last only."""
    return k == count - 1 or (interval is not None and k % interval == 0)


TIMINGS_KEPT = 200_000
"""Calls whose engine seconds ``GET /timings`` answers (the latest): a benchmark phase's calls, and more."""


class Timings:
    """Per seed, the seconds from a call's body read to its last byte sent: the engine's own share of the call."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def timed(self, seed: int, send: Callable) -> Callable:
        """``send`` that records, at the last byte, how long since now."""
        started = time.monotonic()

        async def timing(message: dict) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                if len(self._seconds) >= TIMINGS_KEPT:
                    self._seconds.pop(next(iter(self._seconds)))
                self._seconds[seed] = time.monotonic() - started

        return timing

    def served(self) -> dict[str, float]:
        return {str(seed): seconds for seed, seconds in self._seconds.items()}


class Misbehaving:
    """ASGI middleware: a streaming ``/v1/completions`` request whose reply is scripted to misbehave is
    answered as a broken engine or proxy would (see the module docstring), ``GET /health`` waits the
    engine's ``health_delay``, a seeded call is timed (``GET /timings``); every other request passes."""

    ENGINE_ONLY = ("logprobs", "return_token_ids", "return_tokens_as_token_ids")
    """Fields a ``bare`` answer is asked without, so it carries neither ids nor log-probs."""

    def __init__(self, app: Any, engine: ScriptedEngine) -> None:
        self.app, self.engine = app, engine
        self.timings = Timings()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] == "/health" and self.engine.health_delay > 0:
            return await self._slow_health(scope, receive, send)
        if scope["type"] == "http" and scope["path"] == "/timings":
            return await JSONResponse(self.timings.served())(scope, receive, send)
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        raw = b""
        while True:  # the whole body, to read ``stream`` and perhaps rewrite it
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body, reply = self._body(raw), self.engine.upcoming()
        if body.get("stream") and reply.unstreamed:
            body["stream"] = False  # one JSON answer, to a request that asked for a stream
            if reply.unstreamed == "bare":
                body = {k: v for k, v in body.items() if k not in self.ENGINE_ONLY}
            raw = json.dumps(body).encode()
        elif body.get("stream") and reply.break_after is not None:
            send = self._breaking(send, reply.break_after)
        if isinstance(body.get("seed"), int):
            send = self.timings.timed(body["seed"], send)
        await self.app(scope, self._replaying({"type": "http.request", "body": raw, "more_body": False}, receive),
                       send)

    async def _slow_health(self, scope: dict, receive: Callable, send: Callable) -> None:
        """``GET /health`` answered after ``health_delay`` (on the event loop, off the generations' threads:
        calls go on meanwhile), or not at all if its client gave up first, so no stop waits for it."""
        request = await receive()
        gone = asyncio.ensure_future(receive())  # after the request, only http.disconnect comes
        done, _ = await asyncio.wait({gone}, timeout=self.engine.health_delay)
        if done:
            return None
        gone.cancel()
        await self.app(scope, self._replaying(request, receive), send)

    @staticmethod
    def _replaying(first: dict, receive: Callable) -> Callable:
        """``receive`` that hands out ``first`` (a request already read) before the rest."""
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return first

        return replay

    @staticmethod
    def _body(raw: bytes) -> dict:
        try:
            body = json.loads(raw)
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}

    @staticmethod
    def _breaking(send: Callable, events: int) -> Callable:
        """``send`` that ends the body cleanly after ``events`` events and drops the rest."""
        sent, ended = 0, False

        async def breaking(message: dict) -> None:
            nonlocal sent, ended
            if message["type"] != "http.response.body":
                return await send(message)
            if ended:
                return None
            keep = sent < events
            sent += 1 if keep and message.get("body") else 0
            ended = sent >= events or not message.get("more_body")
            await send({**message, "body": message.get("body", b"") if keep else b"", "more_body": not ended})

        return breaking


BACKLOG = 8192
"""Connections waiting to be accepted: a fleet-size gateway opens one per call in flight, thousands at once
(uvicorn's default, 2,048, drops the rest's SYNs and they time out connecting)."""


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m trajbus.infra.scripted_engine", description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer-path", type=Path, required=True)
    parser.add_argument("--replies", type=Path, required=True,
                        help="JSON list of replies served in turn: texts, or objects with text|fail and delay, "
                             "token_delay, unstreamed, break_after, health_delay or gate")
    parser.add_argument("--record", type=Path, help="append every received prompt to this JSON-lines file")
    parser.add_argument("--served-model-name", default="trajbus-scripted")
    parser.add_argument("--workers", type=int, default=1,
                        help="generations served at once (1: one at a time, as the tiny model's server)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    engine = ScriptedEngine(args.tokenizer_path, json.loads(args.replies.read_text()), args.record,
                            workers=args.workers)
    log.info("scripted engine serving %s on http://%s:%d", args.tokenizer_path, args.host, args.port)
    app = Misbehaving(create_app(engine, args.served_model_name), engine)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", backlog=BACKLOG,
                log_config=None, timeout_graceful_shutdown=5)
    engine.executor.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
