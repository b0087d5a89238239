"""Steps -> verl DataProto: VerlBackend's bulk build against per-row ``tokenizer.pad``.

The baseline pads every step on its own with a Hugging Face tokenizer and stacks
the rows (what the reference design does). Both build the same tensors for 1,024
steps of 2,048 prompt + 512 response tokens. The tokenizer is built here from a
word-level vocabulary: nothing is downloaded. Prints a table and writes
benchmarks/results/convert.json.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from trajbus.consumers.backends import VerlBackend
from trajbus.streams.records import Step
from trajbus.pipelines.tables import print_table

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT, RESPONSE, VOCAB = 2048, 512, 32000


def local_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>")


def make_steps(n: int, seed: int = 0) -> list[Step]:
    rng = random.Random(seed)
    return [Step(prompt_ids=[rng.randrange(1, VOCAB) for _ in range(rng.randint(PROMPT // 2, PROMPT))],
                 response_ids=[rng.randrange(1, VOCAB) for _ in range(rng.randint(RESPONSE // 2, RESPONSE))],
                 trajectory_uid=f"t{i}", prompt_uid=f"p{i // 8}", reward=float(i % 2),
                 rollout_log_probs=None) for i in range(n)]


def per_row_pad(tokenizer: PreTrainedTokenizerFast, steps: list[Step]) -> dict[str, torch.Tensor]:
    """The baseline: one tokenizer.pad call per prompt and per response, then stack."""
    prompts, prompt_masks, responses, response_masks = [], [], [], []
    for step in steps:
        tokenizer.padding_side = "left"
        p = tokenizer.pad({"input_ids": step.prompt_ids}, padding="max_length", max_length=PROMPT,
                          return_tensors="pt", return_attention_mask=True)
        tokenizer.padding_side = "right"
        r = tokenizer.pad({"input_ids": step.response_ids}, padding="max_length", max_length=RESPONSE,
                          return_tensors="pt", return_attention_mask=True)
        prompts.append(p["input_ids"])
        prompt_masks.append(p["attention_mask"])
        responses.append(r["input_ids"])
        response_masks.append(r["attention_mask"])
    prompts_t, responses_t = torch.stack(prompts), torch.stack(responses)
    attention = torch.cat([torch.stack(prompt_masks), torch.stack(response_masks)], dim=1)
    return {"input_ids": torch.cat([prompts_t, responses_t], dim=1), "attention_mask": attention,
            "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0)}


def best_of(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(n: int = 1024) -> dict:
    steps = make_steps(n)
    tokenizer = local_tokenizer()
    backend = VerlBackend(prompt_length=PROMPT, response_length=RESPONSE)
    bulk = backend.convert(steps).batch
    baseline = per_row_pad(tokenizer, steps)
    assert torch.equal(bulk["input_ids"], baseline["input_ids"])  # the same batch, built two ways
    assert torch.equal(bulk["attention_mask"], baseline["attention_mask"])
    pad_s = best_of(lambda: per_row_pad(tokenizer, steps))
    bulk_s = best_of(lambda: backend.convert(steps))
    result = {"steps": n, "prompt_length": PROMPT, "response_length": RESPONSE,
              "per_row_pad_steps_per_s": n / pad_s, "bulk_steps_per_s": n / bulk_s, "speedup": pad_s / bulk_s}
    print(f"\nconvert: {n} steps, prompt {PROMPT} + response {RESPONSE} tokens, best of 3")
    print_table(["path", "steps/s", "ratio"],
                [["per-row tokenizer.pad (baseline)", f"{result['per_row_pad_steps_per_s']:.0f}", "1.00x"],
                 ["VerlBackend.convert (bulk)", f"{result['bulk_steps_per_s']:.0f}", f"{result['speedup']:.2f}x"]])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "convert.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
