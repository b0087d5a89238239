"""Weight updates through the gateway: slow scripted generations are cut mid-response by a pause, the
version moves, and they continue under the new weights; the agents get one reply each, and the steps
say which version sampled which tokens, down to the trainer's tensors.

The scripted engine samples one id per character, each token after ``token_delay``; every token's
log-probability names the weight load that sampled it (``scripted_engine.log_prob``), so the tokens
sampled before and after the swap are told apart by what the engine itself reported.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import torch
from transformers import AutoTokenizer

from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.off_policy import importance_weights
from trajbus.infra.scripted_engine import log_prob, noncanonical_ids
from trajbus.streams.client.policy import PolicyVersionPublisher
from trajbus.streams.wire.records import Step, TrajectoryEnd
from trajbus.streams.wire.topics import groups_topic, steps_topic
from tests.helpers import decode_step_events, fetch_groups, read_to_end, wait_for

LONG = "The quick brown fox jumps over the lazy dog; " * 3
GENERATED = "White-box agents sample token ids and log-probs themselves. " * 2
STREAMED = "Streamed, cut, continued, and whole again at the end."
DELAY = 0.02
ASKED = [{"role": "user", "content": "Tell me something."}]


def agent(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="agent", max_retries=0, timeout=60)


def in_flight(gateway: str) -> int:
    return httpx.get(f"{gateway}/admin/pause").json()["in_flight"]


def metric(gateway: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{gateway}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def expected_log_probs(n_tokens: int, cut_at: int) -> list[float]:
    """What the engine reported: load 1 sampled the tokens before the cut, load 2 the rest."""
    return [log_prob(k, 1 if k < cut_at else 2) for k in range(n_tokens)]


def check_sampled(ids: list[int], log_probs: list[float], segments: list[list[int]], reply_ids: list[int]
                  ) -> int:
    """Exactly the engine's tokens, in two segments (version 0 then 1); returns where the cut fell."""
    assert ids == reply_ids
    assert len(segments) == 2 and segments[0] == [0, 0] and segments[1][1] == 1, segments
    cut_at = segments[1][0]
    assert 0 < cut_at < len(ids)
    assert np.allclose(log_probs, expected_log_probs(len(ids), cut_at), atol=1e-6)
    return cut_at


def received(record: Path) -> list[list[int]]:
    return [json.loads(line)["prompt_ids"] for line in record.read_text().splitlines()]


def test_generations_cut_by_an_update_continue_under_the_new_weights(
        bootstrap_servers, prefix, scripted_engine, start_gateway, start_worker, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reply_ids = {text: noncanonical_ids(tokenizer, text) + [tokenizer.eos_token_id]
                 for text in (LONG, GENERATED, STREAMED)}
    engine, record = scripted_engine([{"text": text, "token_delay": DELAY} for text in (LONG, GENERATED, STREAMED)],
                                     workers=3)
    gateway, _ = start_gateway([engine], ["--response-length", "256"])
    trajectories = [httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": f"update-{k}", "n_rollouts": 1}
                               ).json() for k in range(3)]
    plain, streamed = agent(trajectories[0]["base_url"]), agent(trajectories[1]["base_url"])
    publisher = PolicyVersionPublisher(bootstrap_servers, prefix=prefix)
    publisher.publish(0)
    wait_for(lambda: httpx.get(f"{gateway}/statistics").json()["policy_versions"].get("global") == 0, 30,
             "the gateway to read version 0")

    def load_weights() -> None:
        """While paused: a new call is held back (429, retryable), a second pause changes nothing."""
        refused = httpx.post(f"{trajectories[2]['base_url']}/chat/completions", json={"messages": ASKED})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "paused_for_update"
        again = httpx.post(f"{gateway}/admin/pause").json()
        assert again["paused"] is True and again["cut"] == 0 and again["in_flight"] == 3  # waiting to continue
        loaded = httpx.post(f"http://{engine}/update_weights_from_disk", json={}, timeout=30).json()
        assert loaded["loads"] == 2

    with ThreadPoolExecutor(2) as pool:
        long_call = pool.submit(plain.chat.completions.create, model="m", messages=ASKED)
        wait_for(lambda: in_flight(gateway) == 1, 30, "the first generation to start")
        generate_call = pool.submit(httpx.post, f"{gateway}/generate", json={"prompt_ids": [5, 6, 7]}, timeout=60)
        wait_for(lambda: in_flight(gateway) == 2, 30, "the white-box generation to start")
        stream = streamed.chat.completions.create(model="m", messages=ASKED, stream=True)
        text = ""
        for chunk in stream:  # a few tokens in, the trainer updates the weights
            text += chunk.choices[0].delta.content or ""
            if len(text) >= 5:
                break
        report = publisher.update(1, load=load_weights, gateways=[gateway])
        assert report.cut == {gateway: 3} and report.version == 1
        text += "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        long_reply, generated = long_call.result(), generate_call.result().json()

    assert text == STREAMED and long_reply.choices[0].message.content == LONG
    assert long_reply.choices[0].finish_reason == "stop" and long_reply.usage.completion_tokens == len(reply_ids[LONG])
    cut_generated = check_sampled(generated["response_ids"], generated["log_probs"], generated["version_segments"],
                                  reply_ids[GENERATED])
    assert generated["policy_version"] == 0 and generated["text"] == GENERATED

    assert httpx.post(f"{gateway}/admin/resume", json={"version": 1}).status_code == 200  # idempotent
    older = httpx.post(f"{gateway}/admin/resume", json={"version": 0})
    assert older.status_code == 409 and older.json()["error"]["code"] == "conflict"
    bad = httpx.post(f"{gateway}/admin/resume", json={"version": "next"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "version"
    for trajectory in trajectories[:2]:
        done = httpx.post(f"{trajectory['base_url']}/complete_trajectory", json={"reward": 1.0})
        assert done.status_code == 200 and done.json()["steps"] == 1

    # The steps topic to its end: one step and one end per trajectory, nothing else.
    events = decode_step_events(read_to_end(bootstrap_servers, steps_topic("train", prefix)))
    steps = {e.trajectory_uid: e for e in events if isinstance(e, Step)}
    assert len(events) == 4 and len(steps) == 2 and sum(isinstance(e, TrajectoryEnd) for e in events) == 2
    cuts = {}
    for trajectory, text_sent in zip(trajectories, (LONG, STREAMED)):
        step = steps[trajectory["trajectory_uid"]]
        assert step.policy_version == 0  # the version the call began with
        cuts[trajectory["trajectory_uid"]] = check_sampled(step.response_ids, step.rollout_log_probs,
                                                           step.version_segments, reply_ids[text_sent])
    # The engine was asked each call once, then each continuation: prompt + the tokens before the cut.
    prompts = received(record)
    wanted = [steps[t["trajectory_uid"]] for t in trajectories[:2]]
    assert sorted(map(tuple, prompts[:3])) == sorted([tuple(s.prompt_ids) for s in wanted] + [(5, 6, 7)])
    assert sorted(map(tuple, prompts[3:])) == sorted(
        [tuple(s.prompt_ids + s.response_ids[:cuts[s.trajectory_uid]]) for s in wanted]
        + [(5, 6, 7, *reply_ids[GENERATED][:cut_generated])])

    # The trainer sees each token's version, and weighs and masks by it.
    start_worker(n_rollouts=1)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        groups = fetch_groups(consumer, 2, timeout=60)
    assert len(read_to_end(bootstrap_servers, groups_topic("train", prefix))) == 2
    trained = [group.steps[0] for group in groups]
    batch = VerlBackend(512, 256).convert(trained, current_version=1)
    mask = batch.batch["response_mask"]
    for row, step in enumerate(trained):
        n, cut_at = len(step.response_ids), cuts[step.trajectory_uid]
        assert batch.batch["token_policy_version"][row, :n].tolist() == [0] * cut_at + [1] * (n - cut_at)
        assert batch.batch["token_staleness"][row, :n].tolist() == [1] * cut_at + [0] * (n - cut_at)
    rollout = batch.batch["rollout_log_probs"]
    weights, keep = importance_weights(rollout, rollout, mask, token_versions=batch.batch["token_policy_version"],
                                       current_version=1, max_staleness=0)
    assert torch.equal(keep, mask.bool() & (batch.batch["token_policy_version"] == 1))
    assert torch.equal(weights, keep.float())

    assert metric(gateway, 'trajbus_gateway_generations_total{event="cut"}') == 3
    assert metric(gateway, 'trajbus_gateway_generations_total{event="continued"}') == 3
    assert metric(gateway, "trajbus_gateway_pause_seconds_count") == 1
    shown = httpx.get(f"{gateway}/dashboard/data", timeout=30).json()["updates"]
    assert (shown["paused"], shown["version"], shown["updates"], shown["cut"], shown["continued"]) == (
        False, 1, 1, 3, 3) and shown["mean_pause_s"] > 0
    publisher.close()


def test_a_pause_past_its_limit_ends_held_and_cut_calls_retryably(
        bootstrap_servers, prefix, scripted_engine, start_gateway):
    engine, _ = scripted_engine([{"text": LONG, "token_delay": 0.05}, "Short."])
    gateway, _ = start_gateway([engine], ["--response-length", "256", "--max-pause", "1"])
    first, second = (httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": f"limit-{k}"}).json()
                     for k in range(2))
    with ThreadPoolExecutor(2) as pool:
        cut_call = pool.submit(agent(first["base_url"]).chat.completions.create, model="m", messages=ASKED)
        wait_for(lambda: in_flight(gateway) == 1, 30, "the generation to start")
        paused = httpx.post(f"{gateway}/admin/pause", json={}).json()
        assert paused["cut"] == 1 and paused["serving"] is None
        held = pool.submit(httpx.post, f"{second['base_url']}/chat/completions", params={"wait": 30},
                           json={"messages": ASKED}, timeout=60)
        try:
            cut_call.result()
            raise AssertionError("a call cut past --max-pause was answered")
        except openai.InternalServerError as exc:
            assert exc.status_code == 503 and exc.response.headers["Retry-After"] == "1"
            assert exc.body["code"] == "paused_too_long"
        answer = held.result()
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "paused_too_long"
    assert httpx.post(f"{gateway}/admin/resume", json={"version": 3}).json()["paused"] is False
    again = agent(second["base_url"]).chat.completions.create(model="m", messages=ASKED)
    assert again.choices[0].message.content == "Short."
    events = decode_step_events(read_to_end(bootstrap_servers, steps_topic("train", prefix)))
    assert [(e.trajectory_uid, e.policy_version, e.version_segments) for e in events] == [
        (second["trajectory_uid"], 3, None)]  # the cut call published nothing; the retry the new version


def test_calls_held_through_an_update_are_stamped_with_the_version_it_brings(
        bootstrap_servers, prefix, scripted_engine, start_gateway):
    """A call that arrives during the pause waits (``?wait=``) and samples under the resumed weights: its step
    and ``/generate``'s answer say the resumed version, not the one served when the call arrived."""
    engine, _ = scripted_engine(["Held.", "Held too."])
    gateway, _ = start_gateway([engine], ["--response-length", "64"])
    trajectory = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "held"}).json()
    assert httpx.post(f"{gateway}/admin/pause", json={}).json()["cut"] == 0
    with ThreadPoolExecutor(2) as pool:
        chat = pool.submit(httpx.post, f"{trajectory['base_url']}/chat/completions", params={"wait": 30},
                           json={"messages": ASKED}, timeout=60)
        generate = pool.submit(httpx.post, f"{gateway}/generate", params={"wait": 30},
                               json={"prompt_ids": [5, 6, 7]}, timeout=60)
        wait_for(lambda: httpx.get(f"{gateway}/admin/pause").json()["held"] == 2, 30, "both calls to be held")
        assert httpx.post(f"{gateway}/admin/resume", json={"version": 4}).status_code == 200
        assert chat.result().status_code == 200
        answer = generate.result().json()
    assert answer["policy_version"] == 4 and answer["version_segments"] is None
    assert httpx.get(f"{gateway}/admin/pause").json()["held"] == 0
    events = decode_step_events(read_to_end(bootstrap_servers, steps_topic("train", prefix)))
    assert [(e.trajectory_uid, e.policy_version, e.version_segments) for e in events] == [
        (trajectory["trajectory_uid"], 4, None)]


def test_a_call_read_as_one_answer_is_waited_for_not_cut(bootstrap_servers, prefix, scripted_engine, start_gateway):
    engine, record = scripted_engine([{"text": STREAMED, "token_delay": DELAY}])
    gateway, _ = start_gateway([engine], ["--response-length", "256", "--engine-streaming", "when-asked"])
    trajectory = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "whole"}).json()
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(agent(trajectory["base_url"]).chat.completions.create, model="m", messages=ASKED)
        wait_for(lambda: in_flight(gateway) == 1, 30, "the generation to start")
        paused = httpx.post(f"{gateway}/admin/pause", timeout=30).json()
        assert paused["cut"] == 0 and paused["in_flight"] == 0  # it returned once the generation had ended
        assert httpx.post(f"{gateway}/admin/resume", json={"version": 1}).status_code == 200
        assert call.result().choices[0].message.content == STREAMED
    assert len(received(record)) == 1
    events = decode_step_events(read_to_end(bootstrap_servers, steps_topic("train", prefix)))
    assert [(e.policy_version, e.version_segments) for e in events] == [(0, None)]


def test_each_choice_of_an_n_2_call_continues_on_its_own(
        bootstrap_servers, prefix, scripted_engine, start_gateway, tiny_model_dir):
    """The engine samples choice 0 first: the cut finds it part-way and choice 1 not begun. Choice 0
    continues its reply; choice 1 is sampled whole by the new version (one run, not policy_version's)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    second = "A second choice."
    engine, record = scripted_engine([{"text": LONG, "token_delay": DELAY}, second])
    gateway, _ = start_gateway([engine], ["--response-length", "256"])
    trajectory = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "choices", "n_rollouts": 2}).json()
    texts = ["", ""]
    stream = agent(trajectory["base_url"]).chat.completions.create(model="m", messages=ASKED, n=2, stream=True)
    for chunk in stream:  # a few tokens of choice 0 in, the update
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
        if len(texts[0]) >= 5:
            break
    assert httpx.post(f"{gateway}/admin/pause").json()["cut"] == 1
    assert httpx.post(f"{gateway}/admin/resume", json={"version": 2}).status_code == 200
    for chunk in stream:
        if chunk.choices:
            texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == [LONG, second]
    done = httpx.post(f"{trajectory['base_url']}/complete_trajectory", json={"reward": 0.5}).json()
    assert done["steps"] == 2
    events = decode_step_events(read_to_end(bootstrap_servers, steps_topic("train", prefix)))
    first, other = sorted((e for e in events if isinstance(e, Step)), key=lambda s: s.step_index)
    assert first.response_ids == noncanonical_ids(tokenizer, LONG) + [tokenizer.eos_token_id]
    assert first.policy_version == other.policy_version == 0
    assert first.version_segments[0] == [0, 0] and first.version_segments[1][1] == 2
    assert other.version_segments == [[0, 2]]
    assert len(received(record)) == 3  # the call, then one continuation per choice
