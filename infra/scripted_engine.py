"""An OpenAI/vLLM-compatible engine that answers from a script, instantly and token-exactly.

Two things need an engine whose output is known in advance: tests of token
consistency, where the sampled ids must be a non-canonical encoding of their
text (as real engines sample at temperature > 0: BPE has many encodings of one
string), and the gateway benchmark, where the engine must cost nothing so the
figure is the gateway's own. This engine serves the same HTTP API as
``infra.inference_server`` (it is that server's app around another engine): each
request gets the next reply of the script, encoded character by character and
ended by EOS, and every prompt it received can be appended to a JSON-lines file.
A reply may also be ``{"text": ..., "delay": seconds}`` (a slow call) or
``{"fail": message, "delay": seconds}`` (a call the engine fails with HTTP 500),
so tests can script an engine's faults.

Run: ``python -m trajbus.infra.scripted_engine --tokenizer-path DIR --replies replies.json --port 8000``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trajbus.infra.inference_server import RequestError, Sample, SamplingParams, create_app

log = logging.getLogger("trajbus.scripted_engine")


@dataclass
class ScriptedReply:
    text: str
    ids: list[int]
    delay: float = 0.0
    fail: str | None = None


def log_probs(count: int) -> list[float]:
    """Varied, deterministic log-probabilities (a real engine's are never constant)."""
    return [-0.01 - 0.37 * ((k * 7919) % 13) / 13 for k in range(count)]


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
                 max_length: int = 1 << 20) -> None:
        from transformers import AutoTokenizer

        if not replies:
            raise ValueError("replies: the script needs at least one reply")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.model_dir = tokenizer_path
        self.max_length = max_length
        self.loads = 1
        self._replies = itertools.cycle([self._scripted(reply) for reply in replies])
        self._record = record
        self._lock = threading.Lock()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scripted")

    def _scripted(self, reply: str | dict[str, Any]) -> ScriptedReply:
        if isinstance(reply, str):
            reply = {"text": reply}
        text = reply.get("text", "")
        return ScriptedReply(text, noncanonical_ids(self.tokenizer, text) + [self.tokenizer.eos_token_id],
                             float(reply.get("delay", 0.0)), reply.get("fail"))

    def generator(self, seed: int | None) -> None:
        return None

    def load_weights(self, model_dir: Path) -> float:
        raise RequestError("a scripted engine has no weights to load")

    def sample(self, prompt_ids: list[int], params: SamplingParams, generator: None,
               on_token: Callable[[int, float, str], None] | None = None) -> Sample:
        with self._lock:
            reply = next(self._replies)
            if self._record is not None:
                with self._record.open("a") as out:
                    out.write(json.dumps({"prompt_ids": prompt_ids}) + "\n")
        time.sleep(reply.delay)  # the scripted engine's latency
        if reply.fail is not None:
            raise RuntimeError(reply.fail)
        text, ids, finish = reply.text, reply.ids, "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[:params.max_tokens], "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        values = log_probs(len(ids))
        if on_token is not None:
            for k, token in enumerate(ids):
                on_token(token, values[k], self.tokenizer.decode(ids[:k + 1], skip_special_tokens=True))
        return Sample(list(ids), values, text, finish)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m trajbus.infra.scripted_engine", description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer-path", type=Path, required=True)
    parser.add_argument("--replies", type=Path, required=True,
                        help="JSON list of replies served in turn: texts, or objects with text|fail and delay")
    parser.add_argument("--record", type=Path, help="append every received prompt to this JSON-lines file")
    parser.add_argument("--served-model-name", default="trajbus-scripted")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    engine = ScriptedEngine(args.tokenizer_path, json.loads(args.replies.read_text()), args.record)
    log.info("scripted engine serving %s on http://%s:%d", args.tokenizer_path, args.host, args.port)
    uvicorn.run(create_app(engine, args.served_model_name), host=args.host, port=args.port, log_level="warning",
                log_config=None, timeout_graceful_shutdown=5)
    engine.executor.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
