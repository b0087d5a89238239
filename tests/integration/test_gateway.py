"""The gateway against the real broker, a real inference server and the official openai client."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from trajbus.consumers import BatchConsumer
from trajbus.gateway.state.trajectories import RESERVED_STEPS
from trajbus.infra.tiny_model import WEATHER_TOOL
from trajbus.infra.topics import describe_topics, ensure_topics
from trajbus.streams.client.policy import PolicyVersionPublisher
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.records import Step, TrajectoryEnd
from trajbus.streams.wire.topics import steps_topic
from tests.helpers import decode_step_events, end_offsets, fetch_groups, read_topic, wait_for

REWARD_FN = "tests.gateway_rewards:exact_match"


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="agent", max_retries=0, timeout=60)


def init(gateway: str, headers: dict | None = None, **body) -> dict:
    response = httpx.post(f"{gateway}/init_trajectory", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def step_events(bootstrap_servers: str, prefix: str, count: int) -> list[tuple[bytes, Step | TrajectoryEnd]]:
    messages = read_topic(bootstrap_servers, steps_topic("train", prefix), min_count=count)
    return list(zip([m.key() for m in messages], decode_step_events(messages)))


def assert_the_root_names_init_trajectory(gateway: str) -> None:
    """An OpenAI client pointed at the gateway as at vLLM (``{gateway}/v1``): chat and legacy completions are
    400 missing_trajectory, in OpenAI's error shape, saying how to get a base_url."""
    at_root = client(f"{gateway}/v1")
    calls = (lambda: at_root.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}]),
             lambda: at_root.completions.create(model="tiny", prompt="Hi"))
    for call in calls:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        body = refused.value.response.json()
        assert (refused.value.status_code, refused.value.code) == (400, "missing_trajectory"), body
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["type"] == "invalid_request_error", body
        assert "POST /init_trajectory" in body["error"]["message"] and "base_url" in body["error"]["message"], body


def engine(inference_server: str, prompt_ids: list[int], **sampling) -> dict:
    """The inference server asked directly: what it generates for these ids and settings."""
    body = {"prompt": prompt_ids, "return_token_ids": True, "logprobs": 0, **sampling}
    return httpx.post(f"http://{inference_server}/v1/completions", json=body, timeout=60).json()["choices"][0]


def test_plain_streaming_and_tool_calls_are_captured_token_exactly(
        bootstrap_servers, prefix, inference_server, start_gateway, start_worker, tiny_model_dir):
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
    with PolicyVersionPublisher(bootstrap_servers, prefix=prefix) as publisher:
        publisher.publish(3)
    gateway, process = start_gateway([inference_server])
    wait_for(lambda: httpx.get(f"{gateway}/statistics").json()["policy_versions"].get("global") == 3, 30,
             "the gateway to see policy version 3")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = init(gateway, prompt_uid="weather-0", n_rollouts=1, metadata={"task": "weather"})
    assert t["base_url"] == f"{gateway}/{t['trajectory_uid']}/{t['prompt_uid']}/v1"
    agent = client(t["base_url"])

    calls = []  # (messages, tools, sampling, content or tool calls)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    plain = agent.chat.completions.create(model="tiny", messages=messages, temperature=1.0, seed=11, max_tokens=24)
    calls.append((list(messages), None, {"temperature": 1.0, "seed": 11, "max_tokens": 24},
                  plain.choices[0].message.content))

    messages += [{"role": "assistant", "content": plain.choices[0].message.content},
                 {"role": "user", "content": "Hello"}]
    chunks = list(agent.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=24,
                                                stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The tiny model may sample the whole reply before the first read: how many pieces is the engine's timing
    # (``test_a_streamed_reply_reaches_the_agent_as_the_engine_samples_it`` paces it); the shape is not.
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "stop"
    calls.append((list(messages), None, {"temperature": 0, "max_tokens": 24}, streamed))

    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    tool = agent.chat.completions.create(model="tiny", messages=weather, tools=[WEATHER_TOOL], temperature=0,
                                         max_tokens=40)
    choice = tool.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    calls.append((weather, [WEATHER_TOOL], {"temperature": 0, "max_tokens": 40}, None))

    done = httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 0.75})
    assert done.status_code == 200 and done.json()["steps"] == 3

    events = step_events(bootstrap_servers, prefix, 4)
    assert all(key == t["prompt_uid"].encode() for key, _ in events)
    steps = [e for _, e in events if isinstance(e, Step)]
    assert [s.step_index for s in steps] == [0, 1, 2]
    assert isinstance(events[-1][1], TrajectoryEnd) and events[-1][1].reward == 0.75
    def rendered(conversation, tools) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=True), add_special_tokens=False)

    # The second call continues the first's sampled tokens; the third starts a new conversation.
    turn = tokenizer.encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    expected_prompts = [rendered(*calls[0][:2]), steps[0].prompt_ids + steps[0].response_ids + tokenizer.encode("\n")
                        + turn, rendered(*calls[2][:2])]
    assert [s.metadata.get("segment_start", False) for s in steps] == [False, False, True]
    for step, expected_prompt, (conversation, tools, sampling, content) in zip(steps, expected_prompts, calls):
        assert step.prompt_ids == expected_prompt
        generated = engine(inference_server, step.prompt_ids, **sampling)
        assert step.response_ids == generated["token_ids"], "response ids must be exactly what the engine sampled"
        assert step.rollout_log_probs == pytest.approx(generated["logprobs"]["token_logprobs"], abs=1e-4)
        assert len(step.rollout_log_probs) == len(step.response_ids)
        assert step.response_ids[-1] == tokenizer.eos_token_id
        decoded = tokenizer.decode(step.response_ids, skip_special_tokens=True)
        if content is not None:
            assert decoded == content
        else:
            assert decoded == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        assert step.policy_version == 3 and step.metadata["task"] == "weather"
        assert step.trajectory_uid == t["trajectory_uid"] and step.channel == "train"

    start_worker(n_rollouts=4)  # the trajectory registered n_rollouts=1: its group is complete alone
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        [group] = fetch_groups(consumer, 1, timeout=60)
    assert group.prompt_uid == t["prompt_uid"]
    assert [s.step_index for s in group.steps] == [0, 1, 2]
    assert [s.reward for s in group.steps] == [0.0, 0.0, 0.75] and group.steps[-1].is_last

    # Start-up and first calls are quiet: a line per part saying it is ready, no warning (a backend up at
    # start is "ready", not "back in"; no framework deprecation warning on the first answers).
    log = process.log_file.read_text()
    assert f"backend ready address=http://{inference_server}" in log and "kafka producer ready" in log
    assert [line for line in log.splitlines() if " WARNING " in line or "Warning" in line] == [], log


def test_a_streamed_reply_reaches_the_agent_as_the_engine_samples_it(scripted_engine, start_gateway):
    """One token an engine event, a quarter of a second apart: each reaches the agent as a chunk of its own, while
    the rest is still being sampled, not all at the end."""
    engine, _ = scripted_engine([{"text": "abcdefgh", "token_delay": 0.25}])
    gateway, _ = start_gateway([engine], ["--engine-stream-interval", "1"])
    stream = client(init(gateway, prompt_uid="paced")["base_url"]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Go"}], stream=True)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == "abcdefgh" and len(pieces) >= 4, pieces


def test_reward_function_scores_black_box_trajectories_and_white_box_calls(
        bootstrap_servers, prefix, inference_server, start_gateway, start_worker):
    gateway, _ = start_gateway([inference_server], ["--reward-function", REWARD_FN])
    prompt_uid = "sum-3-4"
    answers = []
    for _ in range(2):  # two rollouts of one prompt: a GRPO group of 2
        t = init(gateway, prompt_uid=prompt_uid, n_rollouts=2, metadata={"answer": "3 + 4 = 7."})
        reply = client(t["base_url"]).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "What is 3 + 4?"}], temperature=0, max_tokens=24)
        answers.append(reply.choices[0].message.content)
        done = httpx.post(f"{t['base_url']}/complete_trajectory")  # no reward: the function scores it
        assert done.status_code == 200, done.text
        assert done.json()["reward"] == float(answers[-1] == "3 + 4 = 7.")
    assert answers[0] == "3 + 4 = 7.", "the tiny model was fitted to answer this"

    start_worker(n_rollouts=4)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        [group] = fetch_groups(consumer, 1, timeout=60)
    assert group.prompt_uid == prompt_uid and len(group.trajectory_uids) == 2
    assert [s.reward for s in group.steps] == [1.0, 1.0]

    scored = httpx.post(f"{gateway}/compute_reward", json={"response_text": "5", "metadata": {"answer": "5"}})
    assert scored.status_code == 200 and scored.json() == {"reward": 1.0}


def test_reward_worker_is_a_named_ray_actor(prefix, inference_server, start_gateway, local_ray):
    from tests.gateway_rewards import RewardActor

    ray = local_ray
    actor = ray.remote(num_cpus=0)(RewardActor).options(name="scorer").remote()
    gateway, process = start_gateway([inference_server], [
        "--reward-worker-name", "scorer", "--ray-namespace", prefix,
        "--ray-address", ray.get_runtime_context().gcs_address])
    scored = httpx.post(f"{gateway}/compute_reward", json={"response_text": "7", "metadata": {"answer": "7"}},
                        timeout=120)
    assert scored.status_code == 200 and scored.json() == {"reward": 1.0}, scored.text
    t = init(gateway, prompt_uid="ray-scored", metadata={"answer": "no such answer"})
    client(t["base_url"]).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=8)
    done = httpx.post(f"{t['base_url']}/complete_trajectory", timeout=120)
    assert done.status_code == 200 and done.json()["reward"] == 0.0
    assert ray.get(actor.count.remote()) == 2
    # Graceful on SIGTERM although Ray's core worker installs its own handler: drained, then exit 0.
    assert process.stop() == 0
    assert "gateway stopped: producer flushed" in process.log_tail(), process.log_tail()


def test_white_box_generate_and_submit_steps(bootstrap_servers, prefix, inference_server, start_gateway):
    gateway, _ = start_gateway([inference_server], ["--api-key", "sesame"])
    auth = {"Authorization": "Bearer sesame"}
    assert httpx.post(f"{gateway}/generate", json={"prompt_ids": [1, 2, 3]}).status_code == 401
    out = httpx.post(f"{gateway}/generate", headers=auth,
                     json={"prompt_ids": [1, 5, 9], "max_tokens": 6, "temperature": 0.7, "seed": 5})
    assert out.status_code == 200, out.text
    body = out.json()
    direct = engine(inference_server, [1, 5, 9], max_tokens=6, temperature=0.7, seed=5)
    assert body["response_ids"] == direct["token_ids"] and len(body["log_probs"]) == len(body["response_ids"])
    assert body["finish_reason"] in ("stop", "length")

    step = {"prompt_ids": [1, 5, 9], "response_ids": body["response_ids"], "trajectory_uid": "wb-0",
            "prompt_uid": "wb", "reward": 1.0, "is_last": True, "rollout_log_probs": body["log_probs"]}
    ok = httpx.post(f"{gateway}/submit_steps?channel=train", headers=auth, json={"steps": [step], "n_rollouts": 1})
    assert ok.status_code == 200 and ok.json() == {"published": 1, "channel": "train"}
    [(key, published)] = step_events(bootstrap_servers, prefix, 1)  # a 200 means acknowledged: already there
    assert key == b"wb" and published.response_ids == body["response_ids"] and published.n_rollouts == 1

    bad = httpx.post(f"{gateway}/submit_steps", headers=auth, json={"steps": [{**step, "step_index": -1}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "steps[0].step_index"
    bad = httpx.post(f"{gateway}/submit_steps?channel=Bad!", headers=auth, json=[step])
    assert bad.status_code == 400 and "channel" in bad.json()["error"]["message"]
    assert sum(end_offsets(bootstrap_servers, steps_topic("train", prefix))) == 1, "refused steps were published"


def test_bad_input_is_refused_with_openai_errors_and_nothing_is_published(
        bootstrap_servers, prefix, inference_server, start_gateway):
    gateway, _ = start_gateway([inference_server], ["--api-key", "sesame", "--max-body-bytes", "100000"])
    auth = {"Authorization": "Bearer sesame"}
    t = init(gateway, headers=auth, prompt_uid="bad-input")
    chat = f"{t['base_url']}/chat/completions"
    ok_messages = [{"role": "user", "content": "Hi"}]
    cases = [
        ("invalid JSON", dict(content=b"{not json", headers={"content-type": "application/json"}), 400, "body"),
        ("wrong type", dict(json={"messages": "hello"}), 400, "messages"),
        ("empty messages", dict(json={"messages": []}), 400, "messages"),
        ("unknown role", dict(json={"messages": [{"role": "wizard", "content": "x"}]}), 400, "messages.0.role"),
        ("negative max_tokens", dict(json={"messages": ok_messages, "max_tokens": -1}), 400, "max_tokens"),
        ("max_tokens over --response-length", dict(json={"messages": ok_messages, "max_tokens": 65}), 400,
         "max_tokens"),
        ("temperature out of range", dict(json={"messages": ok_messages, "temperature": 7}), 400, "temperature"),
        ("user message without content", dict(json={"messages": [{"role": "user"}]}), 400, "messages.0"),
        ("too long", dict(json={"messages": [{"role": "user", "content": "What is 3 + 4? " * 200}]}), 400,
         "messages"),
        ("body too large", dict(json={"messages": [{"role": "user", "content": "x" * 200_000}]}), 413, None),
    ]
    for what, request, status, param in cases:
        response = httpx.post(chat, **request)
        assert response.status_code == status, (what, response.text)
        error = response.json()["error"]
        assert error["message"], what
        if param is not None:
            assert error["param"] == param, (what, error)
    chunked = httpx.post(chat, content=(b"x" * 50_000 for _ in range(3)), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large", chunked.text
    too_long = httpx.post(chat, json={"messages": [{"role": "user", "content": "What is 3 + 4? " * 200}]})
    assert too_long.json()["error"]["code"] == "context_length_exceeded"

    with pytest.raises(openai.BadRequestError, match="messages"):
        client(t["base_url"]).chat.completions.create(model="tiny", messages=[])
    unknown = f"{gateway}/not-a-trajectory/{t['prompt_uid']}/v1/chat/completions"
    assert httpx.post(unknown, json={"messages": ok_messages}).status_code == 404
    wrong_prompt = f"{gateway}/{t['trajectory_uid']}/other/v1/chat/completions"
    assert httpx.post(wrong_prompt, json={"messages": ok_messages}).status_code == 404
    assert httpx.post(f"{gateway}/init_trajectory", json={}).status_code == 401
    assert httpx.post(f"{gateway}/init_trajectory", headers=auth,
                      json={"prompt_uid": "p", "channel": "No Way"}).json()["error"]["param"] == "channel"
    assert httpx.post(f"{gateway}/init_trajectory", headers=auth,
                      json={"prompt_uid": "p", "n_rollouts": 0}).json()["error"]["param"] == "n_rollouts"
    for body in ({}, {"n_rollouts": 2, "prompt_uid": None}, None):  # the rollouts of one prompt share its id
        missing = httpx.post(f"{gateway}/init_trajectory", headers=auth, json=body)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt_uid", missing.text
        assert missing.json()["error"]["code"] == "missing_prompt_uid" and "groups them" in missing.text

    # A misspelled channel: no worker reads it, so it is refused, and no topic is created for it.
    step = {"prompt_ids": [1], "response_ids": [2], "trajectory_uid": "t", "prompt_uid": "p", "is_last": True}
    for typo in (httpx.post(f"{gateway}/init_trajectory", headers=auth, json={"prompt_uid": "p", "channel": "trian"}),
                 httpx.post(f"{gateway}/submit_steps?channel=trian", headers=auth, json=[step])):
        error = typo.json()["error"]
        assert typo.status_code == 400 and (error["code"], error["param"]) == ("unknown_channel", "channel"), error
        assert "known channels: train" in error["message"], error
        assert "trajbus topics --create --channels trian" in error["message"], error
    assert [info.name for info in describe_topics(bootstrap_servers, prefix=prefix) if "trian" in info.name] == []
    # Created explicitly (what `trajbus topics --create --channels trian` does), it is taken at once.
    ensure_topics(bootstrap_servers, TopicSettings(prefix=prefix).channel_specs("trian"))
    assert init(gateway, headers=auth, prompt_uid="p", channel="trian")["channel"] == "trian"
    assert httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 1}).json()["error"]["code"] == \
        "empty_trajectory"

    assert_the_root_names_init_trajectory(gateway)
    assert sum(end_offsets(bootstrap_servers, steps_topic("train", prefix))) == 0, "bad input was published"
    reply = client(t["base_url"]).chat.completions.create(model="tiny", messages=ok_messages, max_tokens=8)
    assert reply.choices[0].message.role == "assistant", "the gateway keeps serving after bad input"
    assert httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 1}).status_code == 200
    assert httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 1}).status_code == 409
    assert httpx.post(chat, json={"messages": ok_messages}).status_code == 409, "a completed trajectory takes no calls"
    assert sum(end_offsets(bootstrap_servers, steps_topic("train", prefix))) == 2


def test_two_backends_one_stopped_mid_run_every_request_succeeds(
        bootstrap_servers, prefix, start_inference_server, start_gateway):
    (first, _), (second, second_process) = start_inference_server(), start_inference_server()
    gateway, _ = start_gateway([first, second])
    trajectories = [init(gateway, prompt_uid=f"p{i}", n_rollouts=1) for i in range(8)]
    calls_per_trajectory = 6
    stopped = threading.Event()

    def run(t: dict) -> int:
        agent = client(t["base_url"])
        for turn in range(calls_per_trajectory):
            if turn == 2 and t is trajectories[0]:
                second_process.stop()  # graceful: in-flight requests finish, new connections are refused
                stopped.set()
            elif turn == 2:  # every trajectory makes its later calls after the stop, however the threads ran
                assert stopped.wait(120), "the second backend was never stopped"
            agent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"What is {turn} + 2?"}],
                                          max_tokens=8, temperature=0)
        return calls_per_trajectory

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(run, trajectories)) == 8 * calls_per_trajectory  # any failure raises here
    assert stopped.is_set()
    stats = httpx.get(f"{gateway}/statistics").json()
    by_address = {b["address"]: b for b in stats["backends"]}
    assert by_address[f"http://{second}"]["healthy"] is False
    assert by_address[f"http://{first}"]["requests"] > by_address[f"http://{second}"]["requests"] > 0
    events = step_events(bootstrap_servers, prefix, 8 * calls_per_trajectory)
    per_trajectory: dict[str, list[int]] = {}
    for _, step in events:
        per_trajectory.setdefault(step.trajectory_uid, []).append(step.step_index)
    assert sorted(per_trajectory.values()) == [list(range(calls_per_trajectory))] * 8


def test_calls_of_a_trajectory_stay_on_one_backend(prefix, start_inference_server, inference_server, start_gateway):
    other, _ = start_inference_server()
    gateway, _ = start_gateway([inference_server, other])
    t = init(gateway, prompt_uid="sticky")
    agent = client(t["base_url"])
    for turn in range(4):
        agent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"What is {turn} + 1?"}],
                                      max_tokens=4)
    requests = sorted(b["requests"] for b in httpx.get(f"{gateway}/statistics").json()["backends"])
    assert requests == [0, 4]


def test_sigkill_mid_trajectory_and_restart_continues_the_same_trajectories(
        bootstrap_servers, prefix, inference_server, start_gateway, start_worker, tmp_path):
    state = tmp_path / "kept-state"
    gateway, process = start_gateway([inference_server], state_dir=state)
    port = int(gateway.rsplit(":", 1)[1])
    trajectories = [init(gateway, prompt_uid="restart", n_rollouts=2, metadata={"i": i}) for i in range(2)]

    def turn(t: dict, k: int) -> None:
        client(t["base_url"]).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"What is {k} + 4?"}], max_tokens=8)

    for t in trajectories:
        for k in range(2):
            turn(t, k)
    process.kill()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{gateway}/health")
    start_gateway([inference_server], port=port, state_dir=state)
    for t in trajectories:
        for k in range(2, 4):
            turn(t, k)
        assert httpx.post(f"{t['base_url']}/complete_trajectory", json={"reward": 1.0}).status_code == 200

    start_worker(n_rollouts=4)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
        [group] = fetch_groups(consumer, 1, timeout=60)
    for t in trajectories:
        steps = [s for s in group.steps if s.trajectory_uid == t["trajectory_uid"]]
        assert [s.step_index for s in steps] == [0, 1, 1 + RESERVED_STEPS, 2 + RESERVED_STEPS]  # past the killed
        assert [s.metadata["i"] for s in steps] == [t_index := trajectories.index(t)] * 4, t_index
        assert steps[-1].reward == 1.0


def test_ready_waits_for_a_backend_and_takes_it_back(prefix, tiny_model_dir, start_gateway, tmp_path):
    from trajbus.pipelines.processes import free_port, inference_server_process, wait_http

    port = free_port()
    gateway, _ = start_gateway([f"127.0.0.1:{port}"], wait=False)
    wait_http(f"{gateway}/health", 60)  # answers at once, before anything is ready
    not_ready = httpx.get(f"{gateway}/ready")
    assert not_ready.status_code == 503 and not_ready.json()["reason"]
    wait_for(lambda: "backend" in httpx.get(f"{gateway}/ready").json().get("reason", ""), 60,
             "the only missing piece to be the backend")
    server = inference_server_process(port, tmp_path / "late-server.log", tiny_model_dir).start()
    try:
        wait_http(f"{gateway}/ready", 120, server)
    finally:
        server.stop()
