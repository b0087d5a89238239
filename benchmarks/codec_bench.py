"""The binary codec against JSON, the usual baseline, on agent-sized steps.

Measures bytes per step and encode/decode throughput for steps of 2,048 prompt
and 512 response tokens with log-probs, for a 32k and a 151k vocabulary.
Prints a table and writes benchmarks/results/codec.json.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict
from pathlib import Path

from trajbus.streams.wire import codec
from trajbus.streams.wire.records import Step
from trajbus.pipelines.tables import print_table

RESULTS = Path(__file__).resolve().parent / "results"


def make_steps(n: int, vocab: int, seed: int = 0) -> list[Step]:
    rng = random.Random(seed)
    return [Step(prompt_ids=[rng.randrange(vocab) for _ in range(2048)],
                 response_ids=[rng.randrange(vocab) for _ in range(512)],
                 trajectory_uid=f"traj-{i}", prompt_uid=f"prompt-{i // 4}", step_index=i % 3,
                 rollout_log_probs=[-rng.random() * 5 for _ in range(512)], metadata={"env": "bench"})
            for i in range(n)]


def rate(fn, items, repeat: int = 3) -> float:
    """Items per second, best of ``repeat`` runs."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, time.perf_counter() - start)
    return len(items) / best


def main(n: int = 300) -> list[dict]:
    rows = []
    for vocab in (32000, 151000):
        steps = make_steps(n, vocab)
        binary = [codec.encode(s) for s in steps]
        as_json = [json.dumps(asdict(s)).encode() for s in steps]
        row = {
            "vocab": vocab,
            "json_bytes": sum(map(len, as_json)) / n,
            "binary_bytes": sum(map(len, binary)) / n,
            "json_encode_per_s": rate(lambda s: json.dumps(asdict(s)).encode(), steps),
            "binary_encode_per_s": rate(codec.encode, steps),
            "json_decode_per_s": rate(lambda b: Step(**json.loads(b)), as_json),
            "binary_decode_per_s": rate(codec.decode, binary),
        }
        rows.append(row)
    print(f"\ncodec: {n} steps of 2048 prompt + 512 response tokens with log-probs (best of 3)")
    print_table(["vocab", "bytes/step json", "binary", "size ratio", "encode/s json", "binary", "ratio",
                 "decode/s json", "binary", "ratio"],
                [[r["vocab"], f"{r['json_bytes']:.0f}", f"{r['binary_bytes']:.0f}",
                  f"{r['json_bytes'] / r['binary_bytes']:.2f}x", f"{r['json_encode_per_s']:.0f}",
                  f"{r['binary_encode_per_s']:.0f}", f"{r['binary_encode_per_s'] / r['json_encode_per_s']:.2f}x",
                  f"{r['json_decode_per_s']:.0f}", f"{r['binary_decode_per_s']:.0f}",
                  f"{r['binary_decode_per_s'] / r['json_decode_per_s']:.2f}x"] for r in rows])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "codec.json").write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
