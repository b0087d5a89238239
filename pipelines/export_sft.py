"""The SFT shape of an export (``trajbus export --shape sft``): a trajectory as the chat and its final reply.

One row per trajectory, the provenance columns of the RL shape (``export_rows``) and:

- ``messages``: the chat the final step was sent, then the final reply as an ``assistant``
  message (the "messages" format of TRL's ``SFTTrainer``); null when the steps carry no chat;
- ``prompt``: the final step's prompt decoded (the chat template's text, special tokens kept);
  null without a tokenizer;
- ``completion``: the final reply, decoded (special tokens skipped).

A step carries its chat when the agent put it in ``metadata["messages"]`` (a list of
``{"role", "content"}``), and may carry its reply's text in ``metadata["completion"]``. Where a
trajectory's steps carry neither, the token ids are decoded with ``--tokenizer``; without one,
``SftUnavailable`` says what is missing.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from trajbus.pipelines.export_rows import PROVENANCE_FIELDS, Provenance, TrajectoryTokens, provenance
from trajbus.streams.wire.prefix import StructuredGroup

__all__ = ["SFT_SCHEMA", "SftRows", "SftUnavailable"]

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
SFT_SCHEMA = pa.schema(PROVENANCE_FIELDS + [("messages", pa.list_(MESSAGE)), ("prompt", pa.string()),
                                            ("completion", pa.string())])


class SftUnavailable(ValueError):
    """A trajectory that cannot be written in the SFT shape with what was given; the text says what is missing."""


def _chat(metadata: dict) -> list[dict] | None:
    messages = metadata.get("messages")
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    return None


class SftRows:
    """Rows of the SFT shape; ``tokenizer``: a Hugging Face tokenizer, or None."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.rows: list[dict] = []
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, trajectory: TrajectoryTokens, group: StructuredGroup, where: Provenance) -> None:
        final = trajectory.steps[-1]
        chat = _chat(final.step.metadata)
        if chat is None and self.tokenizer is None:
            raise SftUnavailable(f"--shape sft: trajectory {trajectory.uid}'s steps carry no chat "
                                 f"(metadata.messages); give --tokenizer PATH to decode their token ids")
        completion = final.step.metadata.get("completion")
        if not isinstance(completion, str):
            completion = self._decode(final.step.response_ids, trajectory, skip_special_tokens=True)
        prompt = None if self.tokenizer is None else self._decode(final.prompt(), trajectory)
        row = provenance(trajectory, group, where)
        row.update(messages=None if chat is None else chat + [{"role": "assistant", "content": completion}],
                   prompt=prompt, completion=completion)
        self.rows.append(row)
        self.nbytes += len(completion) + len(prompt or "") + sum(len(m["content"]) for m in chat or ())

    def _decode(self, ids: Any, trajectory: TrajectoryTokens, **options: bool) -> str:
        if self.tokenizer is None:
            raise SftUnavailable(f"--shape sft: trajectory {trajectory.uid}'s final step carries no reply text "
                                 f"(metadata.completion); give --tokenizer PATH to decode its token ids")
        return self.tokenizer.decode([int(i) for i in ids], **options)

    def table(self) -> pa.Table:
        return pa.Table.from_pylist(self.rows, schema=SFT_SCHEMA)
