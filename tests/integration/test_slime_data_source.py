"""slime's data source on the real broker: every prompt of an epoch trained exactly once in the model
slime resumes, through a checkpoint, two rollouts trained after it, and a crash mid-rollout; surplus
and aborted groups back in the buffer, filtered ones recorded with their reason."""

from __future__ import annotations

import argparse
import json

from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.slime import SlimeDataSource
from trajbus.pipelines.slime.sglang import generate_rollout
from tests.helpers import audit_report

PROMPTS = 12


def slime_args(tmp_path, bootstrap_servers: str, prefix: str) -> argparse.Namespace:
    """slime's own argument names, and trajbus's keys as its --custom-config-path YAML sets them."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"text": f"q{i}", "label": str(i)}) + "\n" for i in range(PROMPTS)))
    return argparse.Namespace(
        prompt_data=str(data), input_key="text", label_key="label", metadata_key="metadata", tool_key=None,
        apply_chat_template=False, rollout_max_prompt_len=None, n_samples_per_prompt=2, rollout_global_dataset=True,
        rollout_shuffle=True, rollout_seed=5, save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"),
        buffer_filter_path=None, dynamic_sampling_filter_path="tests.slime_rollouts.drop_label_3",
        rollout_batch_size=2, over_sampling_batch_size=4, hf_checkpoint=None,
        trajbus_bootstrap_servers=bootstrap_servers, trajbus_prefix=prefix,
        trajbus_rollout_function_path="tests.slime_rollouts.sglang_like")


def train(source: SlimeDataSource, args: argparse.Namespace, rollout_id: int) -> list[int]:
    """One step of slime's train loop: generate rollout ``rollout_id``; the group indices it trained."""
    return [group[0].group_index for group in generate_rollout(args, rollout_id, source).samples]


def test_a_resumed_run_trains_each_prompt_once_and_loses_no_surplus_or_aborted_group(
        bootstrap_servers, prefix, tmp_path):
    args = slime_args(tmp_path, bootstrap_servers, prefix)
    first = SlimeDataSource(args)
    assert not first.load(-1), "slime loads start_rollout_id - 1: nothing yet"
    trained = {}
    for rollout_id in range(5):  # slime's train loop: generate, train, save every third rollout
        trained[rollout_id] = train(first, args, rollout_id)
        if rollout_id == 2:
            assert first.save(rollout_id).exists()
    assert first.get_buffer_length() > 0, "surplus and aborted groups wait in the buffer"
    # the last checkpoint is rollout 2's: rollouts 3 and 4 were trained into a model that is lost
    first.begin_rollout(5)
    first.get_samples(4)  # and the run dies mid-rollout 5
    first.close()

    second = SlimeDataSource(args)
    assert second.load(2)
    kept = [index for rollout_id in range(3) for index in trained[rollout_id]]
    lost = {index for rollout_id in (3, 4) for index in trained[rollout_id] if index < PROMPTS}
    again: list[int] = []
    rollouts_after_load = 0
    for rollout_id in range(3, 30):
        again += train(second, args, rollout_id)
        rollouts_after_load += 1
        epoch = [index for index in kept + again if index < PROMPTS]
        if len(set(epoch)) == PROMPTS - 1:
            break
    second.close()

    epoch = [index for index in kept + again if index < PROMPTS]
    assert sorted(epoch) == sorted(set(epoch)), "no prompt is trained twice in the resumed model"
    assert lost <= set(again), "the groups trained after the checkpoint are trained again"
    with PromptLedger(bootstrap_servers, prefix=prefix) as ledger:
        ledger.refresh()
        view = ledger.view
    reasons = {uid: view.dropped_for(uid) for uid in view.dispatched}
    filtered = [view.dispatched[uid].sample_indices[0] // 2 for uid, reason in reasons.items()
                if reason == "filtered: label_3"]
    assert len([index for index in filtered if index < PROMPTS]) == 1, "filtered in the epoch once, with its reason"
    dropped_index = min(filtered)
    assert set(epoch) | {dropped_index} == set(range(PROMPTS)) and dropped_index not in epoch
    assert sum(reason == "returned to the buffer" for reason in reasons.values()) >= 4, \
        "surplus and aborted groups went back to the buffer"
    code, report = audit_report(bootstrap_servers, prefix, "train", "--live")  # the last rollout over-sampled
    assert (code, report["violations"], report["steps"]) == (0, [], 3 + rollouts_after_load), report["violations"]
    assert report["counts"]["trained"] == len(kept) + len(again), "each trained group at one step of the model"
    assert report["counts"]["re-issued"] == len({i for r in (3, 4) for i in trained[r]}), \
        "rollouts 3 and 4, rolled back by the resume, were handed out again"
