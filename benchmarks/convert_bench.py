"""Steps -> verl DataProto: VerlBackend's bulk build against per-row ``tokenizer.pad``.

The baseline pads every step on its own with a Hugging Face tokenizer and stacks
the rows (what the reference design does). Both build the same tensors for 1,024
steps of 2,048 prompt + 512 response tokens. The tokenizer is built here from a
word-level vocabulary: nothing is downloaded.

Where CUDA is available it also times the GPU path of the Ray batch workers: the
built DataProto's tensors staged in pinned host memory and copied without blocking
(``consumers.gpu_worker.to_device``, what ``BatchWorker.next_batch`` runs), against
a plain pageable ``.to("cuda")`` of the same tensors in the same run, and the copy
alone from tensors already pinned; each as ms per batch (median of several copies)
and GB/s, and end to end as steps/s from steps to a batch on the GPU (convert plus
copy). Without CUDA those rows are skipped, and the table and the JSON say so.
Prints the tables and writes benchmarks/results/convert.json.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.gpu_worker import to_device
from trajbus.streams.wire.records import Step
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


def shallow(batch):
    """A DataProto over the same CPU tensors: ``to_device`` replaces a batch's tensors in place, so each
    timed copy starts from its own."""
    from verl import DataProto

    return DataProto(batch=batch.batch.copy(), non_tensor_batch=dict(batch.non_tensor_batch),
                     meta_info=dict(batch.meta_info))


def pageable_to_device(batch, device):
    """The baseline: the same loop as ``to_device`` with a plain blocking ``.to(device)`` of pageable memory."""
    for key in list(batch.batch.keys()):
        batch.batch[key] = batch.batch[key].to(device)
    torch.cuda.current_stream(device).synchronize()
    return batch


def pinned_to_device(pinned: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """The copy alone: tensors already in pinned memory, copied without blocking, one wait."""
    out = {key: tensor.to(device, non_blocking=True) for key, tensor in pinned.items()}
    torch.cuda.current_stream(device).synchronize()
    return out


def copy_times(fn, make_input, repeat: int) -> list[float]:
    """Seconds of ``fn(input)`` for ``repeat`` inputs made outside the timing (after one warm-up)."""
    fn(make_input())
    times = []
    for _ in range(repeat):
        arg = make_input()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - start)
    return times


def gpu_paths(steps: list[Step], backend: VerlBackend, repeat: int = 20) -> dict:
    """The CUDA rows: copies of one built batch to the GPU, and steps -> batch on the GPU end to end."""
    device = torch.device("cuda", torch.cuda.current_device())
    cpu = backend.convert(steps)
    nbytes = sum(t.numel() * t.element_size() for t in cpu.batch.values())
    on_gpu = to_device(shallow(cpu), device)
    for key in cpu.batch.keys():  # the worker's copy is the same batch, on the GPU
        assert on_gpu.batch[key].device == device and torch.equal(on_gpu.batch[key].cpu(), cpu.batch[key]), key
    pinned = {key: t.pin_memory() for key, t in cpu.batch.items()}
    paths = {
        "pageable": copy_times(lambda b: pageable_to_device(b, device), lambda: shallow(cpu), repeat),
        "worker_pinned": copy_times(lambda b: to_device(b, device), lambda: shallow(cpu), repeat),
        "prepinned": copy_times(lambda p: pinned_to_device(p, device), lambda: pinned, repeat),
    }
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "batch_bytes": nbytes,
              "tensors": len(cpu.batch.keys()), "repeat": repeat}
    for name, times in paths.items():
        median = statistics.median(times)
        result[name] = {"ms_median": median * 1e3, "ms_min": min(times) * 1e3, "gb_per_s": nbytes / median / 1e9}
    n = len(steps)
    e2e_pinned = best_of(lambda: to_device(backend.convert(steps), device))
    e2e_pageable = best_of(lambda: pageable_to_device(backend.convert(steps), device))
    result["end_to_end_pinned_steps_per_s"] = n / e2e_pinned
    result["end_to_end_pageable_steps_per_s"] = n / e2e_pageable
    return result


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
    if torch.cuda.is_available():
        gpu = result["cuda"] = gpu_paths(steps, backend)
        base = gpu["pageable"]["ms_median"]
        print(f"\nto the GPU ({gpu['device']}, torch {gpu['torch']}): one batch of {gpu['tensors']} tensors, "
              f"{gpu['batch_bytes'] / 1e6:.1f} MB; copies: median of {gpu['repeat']}, end to end: best of 3")
        rows = [[label, f"{gpu[key]['ms_median']:.2f}", f"{gpu[key]['gb_per_s']:.1f}",
                 f"{base / gpu[key]['ms_median']:.2f}x"]
                for label, key in [("pageable .to(cuda) (baseline)", "pageable"),
                                   ("gpu_worker.to_device: pin_memory + non_blocking", "worker_pinned"),
                                   ("copy alone, tensors already pinned", "prepinned")]]
        print_table(["copy", "ms/batch", "GB/s", "ratio"], rows)
        print_table(["steps -> batch on the GPU", "steps/s"],
                    [["convert + pageable .to(cuda)", f"{gpu['end_to_end_pageable_steps_per_s']:.0f}"],
                     ["convert + gpu_worker.to_device", f"{gpu['end_to_end_pinned_steps_per_s']:.0f}"]])
    else:
        result["cuda"] = {"skipped": "CUDA is not available: no GPU copy or end-to-end rows"}
        print("\nto the GPU: skipped, CUDA is not available (the copy and end-to-end rows need a GPU)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "convert.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
