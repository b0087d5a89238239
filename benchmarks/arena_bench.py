"""The tokenizer's encode beside a fleet's heap: on the event loop's thread, and on a thread of its own.

The gateway encodes each call's new text with the Rust ``tokenizers``, which allocates hundreds of blocks an
encode from the C allocator. glibc serves each thread from its arena; the event loop's (the main arena) holds
what thousands of calls keep and free in any order. This builds that heap in one process, as
``benchmarks.fleet_bench`` leaves the gateway's at each turn: every agent's context (a packed array growing by
~2k tokens a turn) and the message strings of the requests in flight (~7 KB each, half of them freed in a
random order), then times the same 1.7k-token encode (``fleet_bench``'s tool output, the tiny model):

- on a clean heap, before any of it (the baseline);
- on the loop's thread, beside the fleet's heap;
- through ``gateway.prompts.encoder_thread.EncoderThread``, as the gateway runs it on glibc (the hand-off
  counted);

each under glibc's malloc (this process) and under mimalloc (a child with it preloaded, ``infra.allocator``: the
gateway's ``--allocator mimalloc``, which encodes on the loop's thread). CPU per encode is the process's
(``time.process_time``: both threads), per level of agents. Prints the table and writes
benchmarks/results/arena.json. ``--agents 256,4096`` by default; about 40 s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Callable

from benchmarks.assembly_bench import RESULTS
from benchmarks.fleet_bench import OUTPUT, TURNS
from benchmarks.targets import Target, print_targets
from trajbus.gateway.prompts.encoder_thread import EncoderThread
from trajbus.gateway.prompts.token_ids import packed
from trajbus.infra import tiny_model
from trajbus.infra.allocator import MIMALLOC, SYSTEM, mimalloc_active, preloaded, return_large_blocks
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


def measure(levels: list[int]) -> dict:
    """This process's figures (its allocator's): the clean heap's encode, then each level's on the loop's thread and
    through the encoder thread."""
    return_large_blocks()  # as the gateway serves (glibc only)
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
    return {"tokens": tokens, "allocator": MIMALLOC if mimalloc_active() else SYSTEM, "levels": rows}


def on_mimalloc(levels: list[int]) -> dict:
    """``measure`` in a child process with mimalloc preloaded, as ``--allocator mimalloc`` runs the gateway."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "mimalloc.json"
        subprocess.run([sys.executable, "-m", "benchmarks.arena_bench", "--agents", ",".join(map(str, levels)),
                        "--measure-to", str(out)], env=preloaded(os.environ), check=True)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.arena_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--agents", default="256,4096", help="agents per level, comma-separated")
    parser.add_argument("--measure-to", type=Path, help=argparse.SUPPRESS)  # the child's figures, as JSON
    args = parser.parse_args(argv)
    levels = [int(n) for n in args.agents.split(",")]
    if args.measure_to is not None:
        args.measure_to.write_text(json.dumps(measure(levels)))
        return {}
    runs = [measure(levels), on_mimalloc(levels)]
    clean = runs[0]["levels"][0]["clean_ms"]  # glibc's clean heap: the baseline of every row
    print_table(["allocator", "agents", "contexts held", "clean heap", "main thread (the loop's)", "encoder thread",
                 "main / glibc clean", "encoder / glibc clean"],
                [[run["allocator"], r["agents"], f"{r['context_mb']:.0f} MB", f"{r['clean_ms']:.3f} ms",
                  f"{r['main_thread_ms']:.3f} ms", f"{r['encoder_thread_ms']:.3f} ms",
                  f"{r['main_thread_ms'] / clean:.2f}x", f"{r['encoder_thread_ms'] / clean:.2f}x"]
                 for run in runs for r in run["levels"]],
                title=f"CPU per encode of a {runs[0]['tokens']}-token text beside the heap of a fleet's contexts "
                      "and requests")
    glibc, mimalloc = runs[0]["levels"][-1], runs[1]["levels"][-1]
    result = {"tokens": runs[0]["tokens"], "runs": runs, "targets": print_targets([
        Target(f"glibc: encode on the encoder thread at {glibc['agents']} agents / clean heap", "<= 1.1x",
               f"{glibc['encoder_thread_ms'] / clean:.2f}x ({glibc['encoder_thread_ms']:.3f} vs {clean:.3f} ms)",
               glibc["encoder_thread_ms"] <= 1.1 * clean),
        Target(f"mimalloc (--allocator mimalloc): encode on the loop's thread at {mimalloc['agents']} agents / glibc's "
               "clean heap", "<= 1.1x",
               f"{mimalloc['main_thread_ms'] / clean:.2f}x ({mimalloc['main_thread_ms']:.3f} vs {clean:.3f} ms)",
               mimalloc["main_thread_ms"] <= 1.1 * clean)], "Targets (issue 47, item 1: the encode's share)")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "arena.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
