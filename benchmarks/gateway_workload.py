"""The workload of ``gateway_bench``: agents' 10-turn conversations with an instant engine, and its levels.

Shared by the benchmark that drives it (``gateway_bench``, ``tracing_bench``) and the report that prints its
figures and targets (``gateway_report``).
"""

from __future__ import annotations

from pathlib import Path

TURNS = 10
REPLY = ("Checked the file; the failing assertion compares the parsed header against the raw bytes, so "
         "the fix is to decode first. Next I will run the tests again and read the output. " * 2)[:300]
OBSERVATION = "$ pytest -q tests/test_parser.py\n" + "F.. assertion failed: header mismatch at offset 42\n" * 14
LEVELS = (1, 32, 256)
FLEET_LEVELS = (32, 256)
FLEET_INSTANCES = 2
TURN_CONVERSATIONS = 100
"""Conversations of the per-turn CPU phase: each turn's phase is this many calls, read to the nanosecond
(``benchmarks.cpu_meter``; read in the kernel's 10 ms ticks, a per-call figure was exact only to 0.1 ms)."""
TURN_SWEEPS = 3
"""Sweeps of every turn in the per-turn CPU phase (new conversations each), the median reported per turn."""
PROCESSES = ("gateway", "engine", "broker", "client")
"""Whose CPU a phase reports (the broker only when this benchmark started it)."""


def conversation(count: int = TURNS, observation: str = OBSERVATION) -> list[list[dict]]:
    """The messages each of ``count`` turns sends (each reply being what the scripted engine answers), each turn
    adding ``observation``, a tool's output."""
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent."}]
    turns = []
    for turn in range(count):
        messages = messages + [{"role": "user", "content": f"Turn {turn}.\n{observation}"}]
        turns.append(messages)
        messages = messages + [{"role": "assistant", "content": REPLY}]
    return turns


def engine_prompts(model_dir: Path, turns: list[list[dict]]) -> tuple[list[list[int]], list[int]]:
    """The prompt ids the gateway sends the engine at each turn (for the direct baseline), and the
    reply's ids."""
    from transformers import AutoTokenizer

    from trajbus.gateway.prompts.conversation import PromptBuilder
    from trajbus.gateway.prompts.token_ids import joined
    from trajbus.infra.scripted_engine import noncanonical_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    builder, reply = PromptBuilder(tokenizer), noncanonical_ids(tokenizer, REPLY) + [tokenizer.eos_token_id]
    prompts, said, context = [], None, None
    for messages in turns:
        prompt = builder.build(messages, None, said, context).ids
        prompts.append(prompt.tolist())
        said, context = messages + [{"role": "assistant", "content": REPLY}], joined(prompt, reply)
    return prompts, reply
