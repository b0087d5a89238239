"""An engine's streamed answer read a batch at a time (``gateway.engine.answers``) is the answer read one event
at a time, however its bytes arrive, and a cut keeps exactly its complete events; without any HTTP request.

The batch reader (``StreamDecoder`` splits what arrived into events, ``merge_chunks`` merges each batch's
tokens into one piece per choice, ``EngineStream`` drives them off ``readany``) replaced a reader that
took one event at a time. Its reference here is such a reader, written from the event-stream rules of the
HTML standard ("Parsing an event stream": lines end with CRLF, LF or CR, a CR being a line's end at once;
``data`` lines joined with LF; a blank line ends the event; ``:`` a comment; ``event`` names it) with one
JSON parse (the standard library's, not orjson) per event. It also says where in the body each event was
complete, which is what a cut after that many bytes must have kept.

The bodies are what engines send to ``/v1/completions`` with ``stream: true``: the project's own engine
(``infra.inference_server``'s chunks, rendered by its own functions), and vLLM's shape (compact JSON,
raw UTF-8, ``top_logprobs``, several tokens in a chunk, two choices interleaved, the last token with the
``finish_reason``, a usage chunk without choices), also with CRLF and CR line ends, comments, named
events, ignored fields and a chunk spread over several ``data`` lines.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import random
from dataclasses import dataclass, field
from typing import Iterator

import orjson
import pytest

from trajbus.gateway.engine.answers import BackendError, Completion, EngineStream
from trajbus.infra.inference_server import _chunk, _sse

ADDRESS = "http://engine:8000"
RID, CREATED, MODEL = "cmpl-7d1c4b2e9f0a4c55b2d8e6f1a3b5c7d9", 1732000000, "Qwen/Qwen2.5-0.5B"


# ---------------------------------------------------------------------------------------------------------
# What the engine sampled, as steps: the chunks it streams, in order.


@dataclass(frozen=True)
class Step:
    """One chunk of one choice: its tokens (id, log-prob), its text delta, its finish_reason."""

    index: int
    tokens: tuple[tuple[int, float], ...] = ()
    text: str = ""
    finish: str | None = None


LOGPROBS = [-0.4521, -1.2345678901234567, -2.220446049250313e-16, -0.0, -13.0, -1e-05, -0.30000000000000004,
            -7.450580596923828e-09, -0.6931471805599453, -3.4028234663852886e+38, -5e-324, -0.1]
"""Log-probs whose exact float a sloppy parse or a rounding would change (hence compared as ``float.hex``)."""


def lp(k: int) -> float:
    return LOGPROBS[k % len(LOGPROBS)]


ONE_CHOICE = [  # the scripted engine's shape: a token a chunk, a half character held, a last chunk without tokens
    Step(0, ((785, lp(0)),), "The"),
    Step(0, ((6210, lp(1)),), " café"),
    Step(0, ((9843, lp(2)),), ""),  # the first byte of a character: its text waits for the next token
    Step(0, ((245, lp(3)), (99, lp(4))), " 🙂"),
    Step(0, ((198, lp(5)),), "\n"),
    Step(0, ((1, lp(6)),), ' says "data: [DONE]\\n\\n"'),  # an event's syntax inside a JSON string
    Step(0, ((151643, lp(7)),), ""),
    Step(0, (), "", "stop"),
]

TWO_CHOICES = [  # vLLM's shape with n=2: interleaved, several tokens a chunk, the last token with its reason
    Step(0, ((40, lp(0)), (1079, lp(1))), "I am"),
    Step(1, ((9707, lp(2)),), "Hello"),
    Step(1, ((11, lp(3)), (1879, lp(4)), (0, lp(5))), ", world!"),
    Step(0, ((264, lp(6)),), " a"),
    Step(0, ((11717, lp(7)), (1614, lp(8))), " 日本語"),
    Step(1, ((151643, lp(9)),), "", "stop"),
    Step(0, ((13, lp(10)), (48, lp(11)), (7, lp(0))), ".\r\t", "length"),
]


@dataclass
class Answer:
    """One choice's answer, added up over its pieces."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    def add(self, token_ids: list[int], logprobs: list[float], text: str, finish_reason: str | None) -> None:
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.text += text
        self.finish_reason = finish_reason or self.finish_reason

    def exact(self) -> tuple:
        """Comparable exactly: each log-prob's float bit for bit (``-0.0`` is not ``0.0``)."""
        return self.token_ids, [v.hex() for v in self.logprobs], self.text, self.finish_reason


def scripted(steps: list[Step]) -> dict[int, tuple]:
    answers: dict[int, Answer] = {}
    for step in steps:
        answers.setdefault(step.index, Answer()).add([t for t, _ in step.tokens], [v for _, v in step.tokens],
                                                     step.text, step.finish)
    return {index: answer.exact() for index, answer in answers.items()}


def answers_of(pieces: list[Completion]) -> dict[int, tuple]:
    answers: dict[int, Answer] = {}
    for piece in pieces:
        answers.setdefault(piece.index, Answer()).add(piece.token_ids, piece.logprobs, piece.text,
                                                      piece.finish_reason)
    return {index: answer.exact() for index, answer in answers.items()}


# ---------------------------------------------------------------------------------------------------------
# Stream bodies: events as lines, rendered with a line end.


def project_engine_events(steps: list[Step], request: dict) -> list[list[str]]:
    """What ``infra.inference_server`` streams for these steps (its own chunk and event functions)."""
    events = []
    for step in steps:
        [line] = _sse(_chunk(request, RID, CREATED, MODEL, step.index, step.text, list(step.tokens),
                             step.finish)).split("\n\n")[:1]
        events.append([line])
    return events + [["data: [DONE]"]]


def vllm_chunk(step: Step, offset: int) -> dict:
    """vLLM's ``CompletionStreamResponse`` of one step (``return_tokens_as_token_ids``, ``logprobs: 1``)."""
    tokens = [f"token_id:{t}" for t, _ in step.tokens]
    logprobs = {"text_offset": [offset + k for k in range(len(tokens))], "token_logprobs": [v for _, v in step.tokens],
                "tokens": tokens, "top_logprobs": [{token: v} for token, (_, v) in zip(tokens, step.tokens)]}
    return {"id": RID, "object": "text_completion", "created": CREATED, "model": MODEL,
            "choices": [{"index": step.index, "text": step.text, "logprobs": logprobs, "finish_reason": step.finish,
                         "stop_reason": 151643 if step.finish == "stop" else None}], "usage": None}


def vllm_chunks(steps: list[Step]) -> list[dict]:
    offsets: dict[int, int] = {}
    chunks = []
    for step in steps:
        chunks.append(vllm_chunk(step, offsets.get(step.index, 0)))
        offsets[step.index] = offsets.get(step.index, 0) + len(step.text)
    usage = {"prompt_tokens": 12, "completion_tokens": sum(len(s.tokens) for s in steps), "total_tokens": 0}
    return chunks + [{"id": RID, "object": "text_completion", "created": CREATED, "model": MODEL, "choices": [],
                      "usage": usage}]


def vllm_events(steps: list[Step]) -> list[list[str]]:
    """vLLM's stream: ``data: `` and compact JSON in raw UTF-8 (pydantic's), a usage chunk, ``[DONE]``."""
    return [["data: " + orjson.dumps(chunk).decode()] for chunk in vllm_chunks(steps)] + [["data: [DONE]"]]


def with_extras(events: list[list[str]]) -> list[list[str]]:
    """The same events with all else a stream may hold: a comment, a named event, an id, a retry, unknown
    fields, a line without a colon, a blank line too many, ``data:`` without its space, and one chunk spread
    over several ``data`` lines (joined with LF, it is the chunk's JSON again)."""
    events = [list(event) for event in events]
    events.insert(0, [": connected", "retry: 3000"])  # no data: no event
    events[1] = ["event: completion", "id: 1", *events[1]]
    events[2] = [events[2][0].replace("data: ", "data:", 1)]
    spread = json.loads(events[3][0][len("data: "):])
    events[3] = [": a chunk over several lines", "foo: bar", "ignored",
                 *("data: " + line for line in json.dumps(spread, indent=1, ensure_ascii=False).split("\n"))]
    events.insert(5, [])  # a blank line too many
    events.insert(7, [": keep-alive"])
    return events


def render(events: list[list[str]], end: str = "\n") -> bytes:
    return "".join("".join(line + end for line in event) + end for event in events).encode()


SCRIPTED_REQUEST = {"logprobs": 1, "return_tokens_as_token_ids": True}
TOKEN_IDS_REQUEST = {"logprobs": 1, "return_token_ids": True}  # ids in "token_ids" too, as vLLM >= 0.10 can

BODIES = {  # name: (body, choices, the steps streamed)
    "project-engine": (render(project_engine_events(ONE_CHOICE, SCRIPTED_REQUEST)), 1, ONE_CHOICE),
    "project-engine-n2-token-ids": (render(project_engine_events(TWO_CHOICES, TOKEN_IDS_REQUEST)), 2, TWO_CHOICES),
    "vllm-n2": (render(vllm_events(TWO_CHOICES)), 2, TWO_CHOICES),
    "vllm-n1-crlf-extras": (render(with_extras(vllm_events(ONE_CHOICE)), "\r\n"), 1, ONE_CHOICE),
    "vllm-n2-cr-extras": (render(with_extras(vllm_events(TWO_CHOICES)), "\r"), 2, TWO_CHOICES),
    "vllm-n2-lf-extras": (render(with_extras(vllm_events(TWO_CHOICES))), 2, TWO_CHOICES),
}
CUT_BODIES = ["project-engine", "vllm-n2", "vllm-n1-crlf-extras", "vllm-n2-cr-extras"]


# ---------------------------------------------------------------------------------------------------------
# The reference: one event at a time.


@dataclass(frozen=True)
class Event:
    complete_at: int
    """Bytes of the body read when it was complete (its blank line's line end read)."""
    type: str
    data: str


def reference_events(body: bytes) -> list[Event]:
    """The body's events by the event-stream rules, each with where it was complete; a line or an event the
    body does not end is no event."""
    events, data, kind, pos = [], [], "", 0
    while True:
        ends = [i for i in (body.find(b"\r", pos), body.find(b"\n", pos)) if i >= 0]
        if not ends:
            return events
        end = min(ends)
        line = body[pos:end].decode()
        pos = end + (2 if body[end:end + 2] == b"\r\n" else 1)  # an LF after a CR ends no second line
        if not line:
            if data:
                events.append(Event(end + 1, kind or "message", "\n".join(data)))
            data, kind = [], ""
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            elif name == "event":
                kind = value


class ReferenceError_(Exception):
    pass


def reference_read(events: list[Event]) -> tuple[dict[int, tuple], bool]:
    """Each choice's answer from these events, one JSON parse each, up to ``[DONE]``; and whether it came."""
    answers: dict[int, Answer] = {}
    for event in events:
        if event.type == "error":
            raise ReferenceError_(event.data)
        if event.data == "[DONE]":
            return {index: answer.exact() for index, answer in answers.items()}, True
        chunk = json.loads(event.data)
        if "error" in chunk:
            raise ReferenceError_(event.data)
        for choice in chunk["choices"]:
            logprobs = choice.get("logprobs") or {}
            if choice.get("token_ids") is not None:
                ids = list(choice["token_ids"])
            else:
                ids = [int(token.removeprefix("token_id:")) for token in logprobs.get("tokens") or []]
            answers.setdefault(choice["index"], Answer()).add(
                ids, list(logprobs["token_logprobs"]) if ids else [], choice.get("text") or "",
                choice.get("finish_reason"))
    return {index: answer.exact() for index, answer in answers.items()}, False


class Reference:
    """A body's answer as the reference reads it, whole or cut after ``k`` bytes."""

    def __init__(self, body: bytes) -> None:
        self.events = reference_events(body)
        self._at = [event.complete_at for event in self.events]
        self._cut: dict[int, dict[int, tuple]] = {}

    def whole(self) -> dict[int, tuple]:
        answer, done = reference_read(self.events)
        assert done
        return answer

    def cut(self, k: int) -> dict[int, tuple]:
        """The answer of the events complete in the first ``k`` bytes."""
        complete = bisect.bisect_right(self._at, k)
        if complete not in self._cut:
            self._cut[complete] = reference_read(self.events[:complete])[0]
        return self._cut[complete]


# ---------------------------------------------------------------------------------------------------------
# EngineStream's side: a fake backend and response.


class FakeLiveness:
    def __init__(self) -> None:
        self.answered_at: list[float] = []

    def answered(self, now: float) -> None:
        self.answered_at.append(now)


@dataclass
class FakeBackend:
    address: str = ADDRESS
    failures: int = 0
    in_flight: int = 1
    liveness: FakeLiveness = field(default_factory=FakeLiveness)


class FakeContent:
    """``readany``: the reads given, then the body's end (``b""``), or (``hang``) nothing more, as an engine
    still generating."""

    def __init__(self, reads: list[bytes], hang: bool) -> None:
        self.reads, self.hang, self.read = list(reads), hang, 0
        self.drained = asyncio.Event()

    async def readany(self) -> bytes:
        if self.reads:
            data = self.reads.pop(0)
            self.read += len(data)
            return data
        self.drained.set()
        if self.hang:
            await asyncio.get_running_loop().create_future()
        return b""

    def at_eof(self) -> bool:
        """aiohttp's: the body ended and every byte was read."""
        return not self.reads and not self.hang


class FakeResponse:
    def __init__(self, reads: list[bytes] = (), content_type: str = "text/event-stream", hang: bool = False,
                 whole: bytes = b"") -> None:
        self.content = FakeContent([r for r in reads if r], hang)  # readany never answers b"" before the end
        self.content_type, self.whole = content_type, whole
        self.released = self.closed = False

    async def read(self) -> bytes:
        return self.whole

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


@dataclass
class Outcome:
    pieces: list[Completion]
    read_at: list[int]
    """Bytes read when each piece was yielded."""
    error: BackendError | None
    backend: FakeBackend
    response: FakeResponse

    def answers(self) -> dict[int, tuple]:
        return answers_of(self.pieces)


async def read(reads: list[bytes], choices: int, *, content_type: str = "text/event-stream", whole: bytes = b"",
               read_interval: float = 0.0) -> Outcome:
    """The pieces an ``EngineStream`` yields for these reads, until it ends (or fails)."""
    backend, response = FakeBackend(), FakeResponse(reads, content_type, whole=whole)
    outcome = Outcome([], [], None, backend, response)
    try:
        async for piece in EngineStream(backend, response, choices, read_interval):
            outcome.pieces.append(piece)
            outcome.read_at.append(response.content.read)
    except BackendError as exc:
        outcome.error = exc
    return outcome


async def cut_after(body: bytes, k: int, choices: int) -> Outcome:
    """The pieces an ``EngineStream`` yields for the first ``k`` bytes of ``body``, read at once, before its
    reader is cancelled (a weight update's cut) while it waits for more."""
    backend, response = FakeBackend(), FakeResponse([body[:k]], hang=True)
    outcome = Outcome([], [], None, backend, response)

    async def consume() -> None:
        async for piece in EngineStream(backend, response, choices):
            outcome.pieces.append(piece)

    reader = asyncio.create_task(consume())
    drained = asyncio.create_task(response.content.drained.wait())
    await asyncio.wait({reader, drained}, return_when=asyncio.FIRST_COMPLETED)
    drained.cancel()
    if not reader.done():
        reader.cancel()
    try:
        await reader
    except asyncio.CancelledError:
        pass
    except BackendError as exc:
        outcome.error = exc
    return outcome


def random_reads(body: bytes, rng: random.Random, most: int = 5) -> list[bytes]:
    reads, pos = [], 0
    while pos < len(body):
        size = rng.randint(1, most)
        reads.append(body[pos:pos + size])
        pos += size
    return reads


def every_split(body: bytes) -> Iterator[list[bytes]]:
    for i in range(1, len(body)):
        yield [body[:i], body[i:]]


def run(coroutine):
    return asyncio.run(coroutine)


# ---------------------------------------------------------------------------------------------------------
# 1. However the bytes arrive, the batch reader's answer is the reference's.


def test_the_reference_reads_what_was_streamed():
    """The reference is not vacuous: each body is read back to exactly the steps the engine streamed."""
    for name, (body, _, steps) in BODIES.items():
        assert Reference(body).whole() == scripted(steps), name
    assert b"\r\n" in BODIES["vllm-n1-crlf-extras"][0] and b"\n" not in BODIES["vllm-n2-cr-extras"][0]
    assert b"event: completion" in BODIES["vllm-n2-lf-extras"][0]


@pytest.mark.parametrize("name", BODIES)
def test_one_read_of_the_whole_body_is_one_piece_a_choice(name):
    body, choices, _ = BODIES[name]
    outcome = run(read([body], choices))
    assert outcome.error is None
    assert outcome.answers() == Reference(body).whole()
    assert sorted(piece.index for piece in outcome.pieces) == list(range(choices))  # merged: one a choice
    assert outcome.response.released and not outcome.response.closed
    assert (outcome.backend.failures, outcome.backend.in_flight, len(outcome.backend.liveness.answered_at)) == (0, 0, 1)


@pytest.mark.parametrize("name", BODIES)
def test_every_split_point_reads_the_same_answer(name):
    body, choices, _ = BODIES[name]
    expected = Reference(body).whole()

    async def every() -> list[tuple[int, Outcome]]:
        return [(len(reads[0]), await read(reads, choices)) for reads in every_split(body)]

    for at, outcome in run(every()):
        assert (at, outcome.error) == (at, None)
        assert (at, outcome.answers()) == (at, expected)
        assert outcome.response.released and outcome.backend.in_flight == 0


@pytest.mark.parametrize("name", BODIES)
def test_random_small_reads_read_the_same_answer(name):
    body, choices, _ = BODIES[name]
    expected = Reference(body).whole()
    rng = random.Random(20241031)

    async def some() -> list[Outcome]:
        return [await read(random_reads(body, rng), choices) for _ in range(20)]

    for outcome in run(some()):
        assert outcome.error is None
        assert outcome.answers() == expected


def test_a_read_interval_waits_between_reads_and_reads_the_same():
    body, choices, _ = BODIES["vllm-n2"]
    reads = [body[i:i + 400] for i in range(0, len(body), 400)]
    outcome = run(read(reads, choices, read_interval=0.001))
    assert outcome.error is None and outcome.answers() == Reference(body).whole()


# ---------------------------------------------------------------------------------------------------------
# 2. A cut keeps the complete events read, and nothing of a partial one.


@pytest.mark.parametrize("name", CUT_BODIES)
def test_a_cut_after_any_byte_keeps_exactly_the_complete_events(name):
    body, choices, _ = BODIES[name]
    reference = Reference(body)

    async def every() -> list[tuple[int, Outcome]]:
        return [(k, await cut_after(body, k, choices)) for k in range(len(body) + 1)]

    done_at = reference.events[-1].complete_at
    assert reference.events[-1].data == "[DONE]"
    for k, outcome in run(every()):
        assert (k, outcome.error) == (k, None)
        assert (k, outcome.answers()) == (k, reference.cut(k))
        finished = k >= done_at  # [DONE] was read: the stream ended, else it was cut (no failure of the engine)
        assert (k, outcome.response.released, outcome.response.closed) == (k, finished, not finished)
        assert (k, outcome.backend.failures, outcome.backend.in_flight, len(outcome.backend.liveness.answered_at)) \
            == (k, 0, 0, int(finished))


@pytest.mark.parametrize("name", CUT_BODIES)
def test_each_read_yields_exactly_the_events_it_completed(name):
    """Read a few bytes at a time: after each read, what was yielded is the complete events so far."""
    body, choices, _ = BODIES[name]
    reference = Reference(body)
    rng = random.Random(7)

    async def some() -> list[tuple[list[bytes], Outcome]]:
        runs = []
        for _ in range(10):
            reads = random_reads(body, rng)
            runs.append((reads, await read(reads, choices)))
        return runs

    for reads, outcome in run(some()):
        assert outcome.error is None
        read_so_far = 0
        for data in reads:
            read_so_far += len(data)
            yielded = [piece for piece, at in zip(outcome.pieces, outcome.read_at) if at <= read_so_far]
            assert (read_so_far, answers_of(yielded)) == (read_so_far, reference.cut(read_so_far))


def test_a_cut_mid_chunk_keeps_the_chunks_before_it():
    """The case spelled out: cut in the middle of the third chunk's JSON, then just before its blank line."""
    body, choices, _ = BODIES["vllm-n2"]
    third = body.index(b"data: ", body.index(b"\n\n", body.index(b"\n\n") + 2))
    first_two = scripted(TWO_CHOICES[:2])
    middle = run(cut_after(body, third + 40, choices))
    assert middle.answers() == first_two and middle.response.closed
    line_end = body.index(b"\n", third)
    assert run(cut_after(body, line_end + 1, choices)).answers() == first_two  # its line, not its event
    assert run(cut_after(body, line_end + 2, choices)).answers() == scripted(TWO_CHOICES[:3])


# ---------------------------------------------------------------------------------------------------------
# 3. An unfinished or broken answer is the engine's fault; a JSON answer is read whole.


def without_done(body: bytes) -> bytes:
    assert body.endswith(b"data: [DONE]\n\n")
    return body[:-len(b"data: [DONE]\n\n")]


@pytest.mark.parametrize("body", [
    without_done(BODIES["vllm-n2"][0]),
    without_done(BODIES["vllm-n2"][0]) + b"data: [DON",
    without_done(BODIES["vllm-n2"][0]) + b"data: [DONE]\n",  # its line, but not its event
], ids=["no-done", "half-a-done", "done-without-its-blank-line"])
def test_a_body_that_ends_before_done_is_the_engines_fault(body):
    for reads in ([body], random_reads(body, random.Random(3))):
        outcome = run(read(reads, 2))
        assert outcome.error is not None and "ended its stream before [DONE]" in str(outcome.error)
        assert outcome.error.status == 502 and ADDRESS in str(outcome.error)
        assert outcome.answers() == Reference(body).cut(len(body))  # what came was yielded, the answer refused
        assert (outcome.backend.failures, outcome.backend.in_flight, outcome.backend.liveness.answered_at) \
            == (1, 0, [])
        assert outcome.response.closed and not outcome.response.released


def test_a_choice_without_its_finish_reason_is_the_engines_fault():
    steps = [step if step.index == 0 else Step(1, step.tokens, step.text) for step in TWO_CHOICES]
    body = render(vllm_events(steps))
    assert Reference(body).whole()[1][3] is None
    for reads in ([body], random_reads(body, random.Random(4))):
        outcome = run(read(reads, 2))
        assert outcome.error is not None and "without finishing choice(s) [1]" in str(outcome.error)
        assert (outcome.backend.failures, outcome.backend.liveness.answered_at) == (1, [])
    missing = run(read([render(vllm_events(TWO_CHOICES[:1] + TWO_CHOICES[3:5] + TWO_CHOICES[6:]))], 2))
    assert "without finishing choice(s) [1]" in str(missing.error)  # a choice asked for, never streamed


@pytest.mark.parametrize("error", [
    [["event: error", 'data: {"message": "engine overloaded", "code": 503}']],
    [["data: " + json.dumps({"error": {"message": "engine overloaded", "type": "InternalServerError", "code": 500}})]],
], ids=["error-event", "error-chunk"])
def test_an_error_mid_stream_is_the_engines_fault(error):
    events = vllm_events(TWO_CHOICES)
    body = render(events[:3] + error + events[3:])
    with pytest.raises(ReferenceError_):
        reference_read(reference_events(body))
    for reads in ([body], random_reads(body, random.Random(5))):
        outcome = run(read(reads, 2))
        assert outcome.error is not None and "failed mid-stream" in str(outcome.error)
        assert "engine overloaded" in str(outcome.error) and outcome.error.status == 502
        assert outcome.response.closed and outcome.backend.liveness.answered_at == []


def test_an_event_not_json_is_the_engines_fault_and_named():
    events = vllm_events(TWO_CHOICES)
    body = render(events[:3] + [["data: <html>502 Bad Gateway</html>"]] + events[3:])
    for reads in ([body], random_reads(body, random.Random(6))):
        outcome = run(read(reads, 2))
        assert outcome.error is not None and "not JSON" in str(outcome.error)
        assert "<html>502 Bad Gateway</html>" in str(outcome.error) and ADDRESS in str(outcome.error)
        assert (outcome.backend.failures, outcome.backend.in_flight) == (1, 0)  # counted once
        assert outcome.response.closed and not outcome.response.released


NOT_IDS = {  # what replaces the token "token_id:9707" (a JSON value), each no id of its own
    "text": b'"Hello"', "empty": b'""', "prefix inside": b'"token_id:97token_id:07"', "comma inside":
    b'"token_id:97,token_id:07"', "no number": b'"token_id:x"', "prefix not first": b'"xtoken_id:9707"',
    "number around": b'"token_id:9707 Hello"', "not a string": b"9707",
}


@pytest.mark.parametrize("token", NOT_IDS.values(), ids=NOT_IDS.keys())
@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
def test_a_token_that_is_no_id_is_the_engines_fault(token, streamed):
    """vLLM's ids are parsed over the tokens joined (``prefixed_ids``), not one at a time: no token's content
    may pass for ids, or shift the ids of the others."""
    if streamed:
        outcome = run(read([render(vllm_events(TWO_CHOICES)).replace(b'"token_id:9707"', token, 1)], 2))
    else:
        whole = vllm_whole_answer(TWO_CHOICES).replace(b'"token_id:9707"', token, 1)
        outcome = run(read([], 2, content_type="application/json", whole=whole))
    assert outcome.error is not None and "no token ids" in str(outcome.error)
    assert outcome.backend.failures == 1


def vllm_whole_answer(steps: list[Step]) -> bytes:
    """vLLM's non-streamed answer of the same steps (what a proxy that buffers, or an engine that ignored
    ``stream``, sends as application/json)."""
    choices = []
    for index in sorted({step.index for step in steps}):
        mine = [step for step in steps if step.index == index]
        tokens = [token for step in mine for token in step.tokens]
        choices.append({"index": index, "text": "".join(step.text for step in mine),
                        "logprobs": {"text_offset": list(range(len(tokens))),
                                     "token_logprobs": [v for _, v in tokens],
                                     "tokens": [f"token_id:{t}" for t, _ in tokens],
                                     "top_logprobs": [{f"token_id:{t}": v} for t, v in tokens]},
                        "finish_reason": next(step.finish for step in mine if step.finish), "stop_reason": None})
    return orjson.dumps({"id": RID, "object": "text_completion", "created": CREATED, "model": MODEL,
                         "choices": choices[::-1], "usage": None})


@pytest.mark.parametrize("steps", [ONE_CHOICE, TWO_CHOICES], ids=["n1", "n2"])
def test_a_json_answer_is_read_whole_with_the_same_ids_and_log_probs(steps):
    choices = len({step.index for step in steps})
    stream = render(vllm_events(steps))
    outcome = run(read([], choices, content_type="application/json", whole=vllm_whole_answer(steps)))
    assert outcome.error is None
    assert outcome.answers() == Reference(stream).whole() == scripted(steps)
    assert [piece.index for piece in outcome.pieces] == list(range(choices))
    assert outcome.response.released and (outcome.backend.failures, outcome.backend.in_flight) == (0, 0)
    assert len(outcome.backend.liveness.answered_at) == 1


def test_a_json_answer_missing_a_choice_is_the_engines_fault():
    outcome = run(read([], 2, content_type="application/json", whole=vllm_whole_answer(ONE_CHOICE)))
    assert outcome.error is not None and "without finishing choice(s) [1]" in str(outcome.error)
    assert outcome.pieces == [] and outcome.backend.failures == 1 and outcome.response.closed
