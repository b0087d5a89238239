"""The tokenizer's encode beside a fleet's heap: on the event loop's thread, and on a thread of its own.

The gateway encodes each call's new text with the Rust ``tokenizers``, which allocates hundreds of blocks an
encode from the C allocator. glibc serves each thread from its arena; the event loop's (the main arena) holds
what thousands of calls keep and free in any order. This builds that heap in one process, as
``benchmarks.fleet_bench`` leaves the gateway's at each turn: every agent's context (a packed array growing by
~2k tokens a turn) and the message strings of the requests in flight (~7 KB each, half of them freed in a
random order), then times the same 1.7k-token encode (``fleet_bench``'s tool output, the tiny model):

- on a clean heap, before any of it (the baseline);
- on the loop's thread, beside the fleet's heap;
- through ``gateway.prompts.encoder_thread.EncoderThread``, as the gateway runs it (the hand-off counted).

CPU per encode is the process's (``time.process_time``: both threads), per level of agents. Prints the table and
writes benchmarks/results/arena.json. ``--agents 256,4096`` by default; about 20 s.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from array import array
from typing import Callable

from benchmarks.assembly_bench import RESULTS
from benchmarks.fleet_bench import OUTPUT, TURNS
from benchmarks.targets import Target, print_targets
from trajbus.gateway.prompts.encoder_thread import EncoderThread
from trajbus.gateway.prompts.token_ids import packed
from trajbus.infra import tiny_model
from trajbus.infra.allocator import return_large_blocks
from trajbus.infra.tokenizer_loading import load_tokenizer
from trajbus.pipelines.tables import print_table

ENCODES = 400
TURN_TOKENS = 2000
MESSAGE_CHARACTERS = 7000


def cpu_per_call(function: Callable[[], object], calls: int = ENCODES) -> float:
    """Milliseconds of the process's CPU per call of ``function`` (after one unmeasured call)."""
    function()
    started = time.process_time()
    for _ in range(calls):
        function()
    return (time.process_time() - started) / calls * 1e3


def fleet_heap(agents: int, seed: int = 1) -> tuple[list[array], list[list[str] | None]]:
    """What the gateway's heap holds after ``TURNS - 2`` turns of ``agents`` agents: their contexts, and the
    message strings of the requests still in flight (half of each turn's, the rest freed in a random order)."""
    rng = random.Random(seed)
    contexts: list[array] = [array("I", range(500)) for _ in range(agents)]
    in_flight: list[list[str] | None] = [None] * agents
    for turn in range(TURNS - 2):
        for agent in rng.sample(range(agents), agents):
            in_flight[agent] = [f"{'x' * MESSAGE_CHARACTERS}{agent}:{i}" for i in range(2 * turn + 2)]
            contexts[agent] = contexts[agent] + array("I", range(TURN_TOKENS))
        for agent in rng.sample(range(agents), agents // 2):
            in_flight[agent] = None
    return contexts, in_flight


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.arena_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--agents", default="256,4096", help="agents per level, comma-separated")
    levels = [int(n) for n in parser.parse_args(argv).agents.split(",")]
    return_large_blocks()  # as the gateway serves
    backend = load_tokenizer(str(tiny_model.build()), True).backend_tokenizer

    def encode() -> array:
        return packed(backend.encode(OUTPUT, add_special_tokens=False).ids)

    tokens, clean = len(encode()), cpu_per_call(encode)
    encoder, rows = EncoderThread(), []
    try:
        for agents in levels:
            heap = fleet_heap(agents)
            on_main, on_thread = cpu_per_call(encode), cpu_per_call(lambda: encoder.run(encode))
            rows.append({"agents": agents, "context_mb": sum(len(c) for c in heap[0]) * 4 / 1e6,
                         "clean_ms": clean, "main_thread_ms": on_main, "encoder_thread_ms": on_thread})
            del heap
    finally:
        encoder.close()
    print_table(["agents", "contexts held", "clean heap", "main thread (the loop's)", "encoder thread", "main / clean",
                 "encoder / clean"],
                [[r["agents"], f"{r['context_mb']:.0f} MB", f"{r['clean_ms']:.3f} ms", f"{r['main_thread_ms']:.3f} ms",
                  f"{r['encoder_thread_ms']:.3f} ms", f"{r['main_thread_ms'] / clean:.2f}x",
                  f"{r['encoder_thread_ms'] / clean:.2f}x"] for r in rows],
                title=f"CPU per encode of a {tokens}-token text beside the heap of a fleet's contexts and requests")
    top = rows[-1]
    result = {"tokens": tokens, "levels": rows, "targets": print_targets([Target(
        f"encode on the encoder thread at {top['agents']} agents / clean heap", "<= 1.1x",
        f"{top['encoder_thread_ms'] / clean:.2f}x ({top['encoder_thread_ms']:.3f} vs {clean:.3f} ms)",
        top["encoder_thread_ms"] <= 1.1 * clean)], "Targets (issue 47, item 1: the encode's share)")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "arena.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
