"""What an engine request asks for and what it answers: sampling parameters parsed with vLLM's rules,
a sample, a streamed sample's tokens in batches, and the errors of a request (shared by
``infra.inference_server`` and ``infra.scripted_engine``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    stream_interval: int = 1
    """Tokens per streamed event, as vLLM's request field: the first and the last event go at once."""


@dataclass
class EngineSample:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class TokenBatches:
    """A streamed generation's tokens, handed from its thread to the server's event loop a stream interval at
    a time (the first token at once), as vLLM's engine hands its API server its outputs: a token a wake-up of
    the loop costs the server more than the events it sends (a paced 300-token reply woke it 300 times for 19
    events at an interval of 16). Batches are ``(choice, [(token, logprob), ...], text so far)``."""

    def __init__(self, interval: int, hand: Callable[[tuple[int, list[tuple[int, float]], str]], None]) -> None:
        self.interval, self.hand = interval, hand
        self._held: dict[int, list[tuple[int, float]]] = {}
        self._text: dict[int, str] = {}
        self._handed: set[int] = set()

    def add(self, index: int, token: int, logprob: float, text: str) -> None:
        """One sampled token (the generation's thread): handed on once the choice holds an interval of them."""
        held = self._held.setdefault(index, [])
        held.append((token, logprob))
        self._text[index] = text
        if index not in self._handed or len(held) >= self.interval:
            self._handed.add(index)
            self._held[index] = []
            self.hand((index, held, text))

    def rest(self) -> list[tuple[int, list[tuple[int, float]], str]]:
        """What is still held, once the generation's thread is done (its items taken at once all the same: a
        cancelled call's thread may still be adding)."""
        rest = [(index, held, self._text[index]) for index, held in list(self._held.items()) if held]
        self._held.clear()
        return rest


class RequestError(ValueError):
    """A request field the server cannot honour (answered with 400)."""


class Aborted(RuntimeError):
    """The client of a streaming request went away: its generation stops at the next token."""


# -- request parsing --------------------------------------------------------------

def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{name}: must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int or value < low:
        raise RequestError(f"{name}: must be an integer >= {low}, got {value!r}")
    return value


def sampling_params(body: dict) -> tuple[SamplingParams, int]:
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop: must be a non-empty string or a list of them")
    max_tokens = _integer(body, "max_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", 16, 1)
    params = SamplingParams(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                            top_p=_number(body, "top_p", 1.0, 1e-6, 1.0), seed=_integer(body, "seed", None, 0),
                            stop=stop, ignore_eos=bool(body.get("ignore_eos", False)),
                            stream_interval=_integer(body, "stream_interval", 1, 1))
    return params, _integer(body, "n", 1, 1)
