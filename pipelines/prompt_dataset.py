"""A prompt file as slime reads it: rows of JSONL or Parquet, and its prompts in each epoch's order.

``PromptDataset`` applies the chat template and the prompt-length filter once, keeps the
original order, and gives each epoch the permutation seeded by ``rollout_seed + epoch``, so
any epoch's order can be rebuilt (a resume re-issues a prompt from its position alone).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from trajbus.consumers.slime.sample import Sample
from trajbus.streams.wire.ledger import fingerprint


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL or Parquet file; a missing file or a bad line is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt_data: no such file {str(path)!r}")
    if path.suffix == ".parquet":
        import pandas

        return pandas.read_parquet(path).to_dict(orient="records")
    rows = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"prompt_data: {path}:{number} is not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise ValueError(f"prompt_data: {path}:{number} is not a JSON object")
            rows.append(row)
    return rows


class PromptDataset:
    """The prompts of one file, in original order, with slime's seeded per-epoch shuffle."""

    def __init__(self, args: Any) -> None:
        tokenizer = None
        if args.apply_chat_template or args.rollout_max_prompt_len is not None:
            if not getattr(args, "tokenizer_path", None):
                raise ValueError("tokenizer_path: needed for apply_chat_template / rollout_max_prompt_len")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
        self.origin_samples: list[Sample] = []
        self.dropped_too_long = 0
        for number, row in enumerate(read_records(args.prompt_data), 1):
            if args.input_key not in row:
                raise ValueError(f"input_key: record {number} of {args.prompt_data} has no {args.input_key!r}")
            if args.label_key is not None and args.label_key not in row:
                raise ValueError(f"label_key: record {number} of {args.prompt_data} has no {args.label_key!r}")
            prompt = row[args.input_key]
            tools = row.get(args.tool_key) if args.tool_key else None
            if args.apply_chat_template:
                messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
                options = getattr(args, "apply_chat_template_kwargs", None) or {}
                prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                       add_generation_prompt=True, **options)
            if args.rollout_max_prompt_len is not None:
                text = prompt if isinstance(prompt, str) else json.dumps(prompt)
                if len(tokenizer.encode(text, add_special_tokens=False)) > args.rollout_max_prompt_len:
                    self.dropped_too_long += 1
                    continue
            metadata = row.get(args.metadata_key) or {}
            self.origin_samples.append(Sample(prompt=prompt, label=row.get(args.label_key) if args.label_key else None,
                                              metadata=dict(metadata), tools=tools))
        if not self.origin_samples:
            raise ValueError(f"prompt_data: {args.prompt_data} has no usable prompts")
        self.seed = args.rollout_seed
        self.samples = list(self.origin_samples)
        self.epoch_id = -1

    def order(self, epoch_id: int) -> list[Sample]:
        """The order of ``epoch_id``: a permutation of the original order, seeded by seed + epoch."""
        permutation = list(range(len(self.origin_samples)))
        random.Random(self.seed + epoch_id).shuffle(permutation)
        return [self.origin_samples[i] for i in permutation]

    def shuffle(self, epoch_id: int) -> None:
        if epoch_id != self.epoch_id:
            self.samples, self.epoch_id = self.order(epoch_id), epoch_id

    @property
    def identity(self) -> str:
        """``<fingerprint>/<size>`` of the prompts in original order (the ledger names it)."""
        return f"{fingerprint((s.prompt, s.label) for s in self.origin_samples)}/{len(self.origin_samples)}"

    def __len__(self) -> int:
        return len(self.samples)
