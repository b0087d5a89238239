"""Agentic scale end to end: 16 rollouts x 40 turns, contexts growing to 62k tokens, sent turn by turn,
through a worker to trainers in both row modes, every token where it belongs."""

from __future__ import annotations

import numpy as np

from benchmarks.agentic_workloads import LONG_CONTEXT, generate
from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.records import Step

W = LONG_CONTEXT


def unpadded(row: np.ndarray, mask: np.ndarray) -> list[int]:
    return row[mask.astype(bool)].tolist()


def fetch_one(bootstrap_servers: str, prefix: str, backend: VerlBackend):
    with BatchConsumer("train", bootstrap_servers, prefix=prefix, group_id=f"{prefix}.{backend.row_mode}",
                       backend=backend) as trainer:
        batch = trainer.fetch_dataproto(1, timeout=180)
    assert batch is not None, f"the group did not reach the {backend.row_mode}-mode trainer"
    return batch


def test_a_long_context_group_reaches_trainers_in_both_row_modes(bootstrap_servers, prefix, start_worker):
    [sent] = generate(W, seed=5)
    assert max(len(s.prompt_ids) for s in sent) > 60_000
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
        start_worker(n_rollouts=W.rollouts)
        for turn in range(W.turns):  # as agents send them: every rollout's turn, then the next turn
            producer.submit_steps([s for s in sent if s.step_index == turn], channel="train")
    trajectories: dict[str, list[Step]] = {}
    for step in sorted(sent, key=lambda s: s.key):
        trajectories.setdefault(step.trajectory_uid, []).append(step)

    per_turn = W.response_tokens + W.tool_tokens
    batch = fetch_one(bootstrap_servers, prefix, VerlBackend(W.task_tokens, W.turns * per_turn, row_mode="trajectory"))
    tensors = batch.batch
    assert tensors["input_ids"].shape[0] == W.rollouts
    for i, uid in enumerate(batch.non_tensor_batch["trajectory_uid"]):
        last = trajectories[uid][-1]
        whole = unpadded(tensors["input_ids"][i].numpy(), tensors["attention_mask"][i].numpy())
        assert whole == last.prompt_ids + last.response_ids, "one row holds the whole conversation"
        assert int(tensors["response_mask"][i].sum()) == W.turns * W.response_tokens, "only sampled tokens train"
        assert float(tensors["rm_scores"][i].sum()) == last.reward

    longest = max(len(s.prompt_ids) for s in sent)
    batch = fetch_one(bootstrap_servers, prefix, VerlBackend(longest, W.response_tokens, row_mode="step"))
    tensors = batch.batch
    assert tensors["prompts"].shape == (W.rollouts * W.turns, longest)
    rows = zip(batch.non_tensor_batch["trajectory_uid"], batch.non_tensor_batch["step_index"])
    for i, (uid, index) in enumerate(rows):
        step = trajectories[uid][index]
        prompt_mask = tensors["attention_mask"][i, :longest].numpy()
        assert unpadded(tensors["prompts"][i].numpy(), prompt_mask) == step.prompt_ids, "every prompt whole"
        assert tensors["responses"][i].tolist() == step.response_ids
        assert np.allclose(tensors["rollout_log_probs"][i].numpy(), step.rollout_log_probs)
