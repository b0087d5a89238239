"""slime's training loop, reduced to what the agentic rollout meets: ``python -m tests.slime_agentic_driver``.

As slime's ``train.py`` does: the data source from ``--data-source-path`` (``SlimeDataSource(args)``), on a
resume ``load(start_rollout_id - 1)``, then per rollout ``generate_rollout(args, rollout_id, data_source)``,
"training" (the prompt_uids of the batch go into the trained list) and the checkpoint: ``save(rollout_id)``
of the data source, then the trained list and the rollout id, written whole. A restart resumes from the last
checkpoint. ``args`` is the JSON file's object. Prints ``rollout <id> started``, ``rollout <id> metrics
<json>`` and ``saved <id>``; ``done`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trajbus.pipelines.slime import SlimeDataSource
from trajbus.pipelines.slime.agentic import close, generate_rollout
from trajbus.pipelines.slime.agents import calculator_agent


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


GATE = "TRAJBUS_TEST_AGENT_GATE"
GATED_FROM = 24
"""The first group whose agents wait at the gate: rollout 2's last eight (its first eight finish)."""


def gated_calculator_agent(base_url: str, sample: Any, sampling: dict[str, Any]) -> float:
    """The calculator agent, except that from group ``GATED_FROM`` on it waits, its trajectory opened, until the
    file ``$TRAJBUS_TEST_AGENT_GATE`` exists (it touches ``<gate>.waiting`` first): a kill meanwhile finds those
    groups cut, however fast or slow the machine."""
    gate = os.environ.get(GATE)
    if gate and sample.group_index >= GATED_FROM:
        Path(gate + ".waiting").touch()
        while not Path(gate).exists():
            time.sleep(0.05)
    return calculator_agent(base_url, sample, sampling)


_crashed: set[int] = set()


def calculator_agent_crashing_once(base_url: str, sample: Any, sampling: dict[str, Any]) -> float:
    """The calculator agent, but the first time it meets group 3 one agent crashes mid-trajectory."""
    if sample.group_index == 3 and sample.index % 4 == 1 and 3 not in _crashed:
        _crashed.add(3)
        raise RuntimeError("the agent crashed")
    return calculator_agent(base_url, sample, sampling)


def every_fifth_group(args: Any, group: list[Any]) -> SimpleNamespace:
    """A dynamic-sampling filter (slime's ``DynamicFilterOutput`` shape): drops groups 0, 5, 10, ..."""
    return SimpleNamespace(keep=group[0].group_index % 5 != 0, reason="every_5th")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--args", required=True, help="slime's args as a JSON object")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--last-rollout", type=int, required=True)
    options = parser.parse_args()
    args = argparse.Namespace(**json.loads(Path(options.args).read_text()))
    checkpoint = Path(options.checkpoint_dir) / "checkpoint.json"
    start, trained = 1, []
    if checkpoint.exists():
        saved = json.loads(checkpoint.read_text())
        start, trained = saved["rollout_id"] + 1, saved["trained"]
    source = SlimeDataSource(args)
    if checkpoint.exists():
        source.load(start - 1)
    for rollout_id in range(start, options.last_rollout + 1):
        say(f"rollout {rollout_id} started")
        output = generate_rollout(args, rollout_id, source)
        say(f"rollout {rollout_id} metrics {json.dumps(output.metrics)}")
        trained += [group[0].prompt_uid for group in output.samples]
        source.save(rollout_id)
        tmp = checkpoint.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rollout_id": rollout_id, "trained": trained}))
        os.replace(tmp, checkpoint)
        say(f"saved {rollout_id}")
    close(source)
    source.close()
    say("done")


if __name__ == "__main__":
    main()
