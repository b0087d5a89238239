"""Nothing a client sends yields a 5xx: the gateway's own OpenAPI schema, fuzzed over HTTP.

Schemathesis generates requests from the schema a live gateway serves at ``/openapi.json``,
valid ones (positive) and ones that break it (negative), for every route: white-box routes
with the API key, black-box routes under a live trajectory's ``base_url``. Every answer must
be below 500, and every error an OpenAI-shaped JSON body. Examples are derandomized
(``derandomize=True``, no example database), so a run is the same on every machine.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

REWARD_FN = "tests.gateway_rewards:exact_match"
API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 12}
"""Per route and mode: 14 routes x 24 = 336 requests, about 30 s with an instant engine."""
LIVE_PATH = "/{trajectory_uid}/{prompt_uid}/v1/"


def openai_error(response: httpx.Response | Any) -> str | None:
    """Why an error answer is not OpenAI-shaped JSON (None when it is)."""
    found = next((value for name, value in response.headers.items() if name.lower() == "content-type"), "")
    content_type = found[0] if isinstance(found, list) and found else found  # schemathesis: a list per name
    if not str(content_type).startswith("application/json"):
        return f"content-type {content_type!r}"
    try:
        error = response.json().get("error")
    except ValueError:
        return "body is not JSON"
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error.get("type"):
        return f"no OpenAI error object: {response.text[:200]}"
    return None


def start(start_gateway, scripted_engine) -> str:
    engine, _ = scripted_engine(["4", "Hello there, how can I help?"])
    gateway, _ = start_gateway([engine], ["--api-key", API_KEY, "--reward-function", REWARD_FN])
    return gateway


def init(gateway: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{gateway}/init_trajectory", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


@dataclass
class Tally:
    statuses: dict[str, Counter] = field(default_factory=dict)
    """Per route: answers by status class."""
    accepted: Counter = field(default_factory=Counter)
    """Per route: valid (positive) requests answered 2xx, of ``EXAMPLES[POSITIVE]``."""
    refused: Counter = field(default_factory=Counter)
    """Why valid (positive) requests were refused: where the schema allows more than the route takes."""
    failures: list[str] = field(default_factory=list)
    """5xx answers and error bodies that are not OpenAI-shaped JSON."""


def live_trajectory(gateway: str) -> dict[str, str]:
    """A trajectory with one step published, so that completing it can succeed: its path parameters."""
    t = init(gateway, prompt_uid="live")
    reply = httpx.post(f"{t['base_url']}/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]},
                       timeout=30)
    assert reply.status_code == 200, reply.text
    return {"trajectory_uid": t["trajectory_uid"], "prompt_uid": t["prompt_uid"]}


def fuzz(operation: Any, mode: GenerationMode, gateway: str, path_parameters: dict[str, str] | None,
         tally: Tally) -> None:
    """Send ``EXAMPLES[mode]`` generated requests of one route; count statuses, note 5xx and bad errors."""
    statuses = tally.statuses.setdefault(operation.label, Counter())

    @settings(max_examples=EXAMPLES[mode], derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(mode, path_parameters=path_parameters))
    def send(case: Any) -> None:
        response = case.call(base_url=gateway, headers=AUTH, timeout=30)
        statuses[response.status_code // 100 * 100] += 1
        if mode is GenerationMode.POSITIVE and response.status_code < 300:
            tally.accepted[operation.label] += 1
        if mode is GenerationMode.POSITIVE and 400 <= response.status_code < 500 and not openai_error(response):
            tally.refused[f"{operation.label}: {response.json()['error']['message'][:100]}"] += 1
        if response.status_code >= 500:
            tally.failures.append(f"{operation.label} {mode.value}: {response.status_code} {response.text[:300]} "
                            f"<- {case.as_curl_command()}")
        elif response.status_code >= 400 and (why := openai_error(response)):
            tally.failures.append(f"{operation.label} {mode.value}: {response.status_code} {why}")

    send()


def test_every_route_of_the_schema_fuzzed_answers_no_server_error(start_gateway, scripted_engine):
    gateway = start(start_gateway, scripted_engine)
    schema = schemathesis.openapi.from_url(f"{gateway}/openapi.json", headers=AUTH, timeout=30)
    tally = Tally()
    for result in schema.get_all_operations():
        operation = result.ok()
        live = None
        if operation.path.startswith(LIVE_PATH):  # a fresh live trajectory per black-box route
            live = live_trajectory(gateway)
        for mode in EXAMPLES:
            try:
                fuzz(operation, mode, gateway, live, tally)
            except Unsatisfiable:  # a route with neither parameters nor a body: nothing to break
                assert mode is GenerationMode.NEGATIVE, operation.label
    print("\nexamples per route, by status class:")
    for label, statuses in tally.statuses.items():
        print(f"  {label}: {sum(statuses.values())} {dict(sorted(statuses.items()))}, "
              f"valid ones accepted: {tally.accepted[label]}")
    print("valid requests refused, most frequent reasons:")
    for why, count in tally.refused.most_common(12):
        print(f"  {count} x {why}")
    assert len(tally.statuses) >= 14, f"routes fuzzed: {sorted(tally.statuses)}"
    assert not tally.failures, "\n".join(tally.failures)
    assert httpx.get(f"{gateway}/ready", timeout=30).status_code == 200, "the gateway keeps serving"


BEYOND_64_BITS = [
    ("/init_trajectory", {"n_rollouts": 10**21}, "n_rollouts"),
    ("/init_trajectory", {"policy_version": 10**21}, "policy_version"),
    ("/init_trajectory", {"policy_version": -10**21}, "policy_version"),
    ("/init_trajectory", {"n_rollouts": 2**32}, "n_rollouts"),  # fits SQLite, not the wire's u32
    ("/generate", {"prompt_ids": [10**21]}, "prompt_ids.0"),
    ("/generate", {"prompt_ids": [1], "policy_version": 2**63, "trajectory_uid": "t"}, "policy_version"),
    ("/generate", {"prompt_ids": [1], "step_index": 2**32}, "step_index"),
    ("/generate", {"prompt_ids": [1], "seed": 10**21}, "seed"),
    ("/generate", {"prompt_ids": [1], "max_tokens": 10**21}, "max_tokens"),
    ("/submit_steps", {"steps": [{"prompt_ids": [1], "response_ids": [2], "trajectory_uid": "t",
                                  "prompt_uid": "p"}], "n_rollouts": 10**21}, "n_rollouts"),
    ("/submit_steps", [{"prompt_ids": [1], "response_ids": [2], "trajectory_uid": "t", "prompt_uid": "p",
                        "policy_version": 10**21}], "steps[0].policy_version"),
    ("/submit_steps", [{"prompt_ids": [1], "response_ids": [2], "trajectory_uid": "t", "prompt_uid": "p",
                        "created_at": 1.6e133}], "steps[0].created_at"),  # found by the fuzzer: the timestamp
]


def test_integers_past_their_width_are_refused_with_openai_errors(start_gateway, scripted_engine):
    """The three inputs found by hand (500 text/plain before), and their kin on every route that
    stores or publishes an integer: a 400 naming the field, and the gateway serves on."""
    gateway = start(start_gateway, scripted_engine)
    t = init(gateway, prompt_uid="wide")
    register, chat = f"{t['base_url']}/register_trajectory", f"{t['base_url']}/chat/completions"
    cases = [(f"{gateway}{path}", body, param) for path, body, param in BEYOND_64_BITS] + [
        (register, {"n_rollouts": 10**21}, "n_rollouts"),
        (register, {"policy_version": -10**21}, "policy_version"),
        (chat, {"messages": [{"role": "user", "content": "Hi"}], "seed": 10**21}, "seed"),
        (chat, {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 10**21},
         "max_completion_tokens"),
    ]
    for url, body, param in cases:
        response = httpx.post(url, json=body, headers=AUTH, timeout=30)
        assert response.status_code == 400, (url, body, response.status_code, response.text)
        assert openai_error(response) is None, (url, body)
        assert response.json()["error"]["param"] == param, (url, body, response.json())
    for content in (b"", b"[1, 2", '"caf\u00e9"'.encode("latin-1"), b"42"):  # bodies that are not steps
        response = httpx.post(f"{gateway}/submit_steps", content=content, timeout=30,
                              headers={**AUTH, "content-type": "application/json"})
        assert response.status_code == 400 and openai_error(response) is None, (content, response.text)
    for body in ({"prompt_uid": "\ud800"}, {"prompt_uid": "p", "metadata": {"k": "\udfff"}}):  # lone surrogates
        response = httpx.post(f"{gateway}/init_trajectory", content=json.dumps(body), timeout=30,
                              headers={**AUTH, "content-type": "application/json"})
        assert response.status_code == 400 and not openai_error(response), (body, response.text)
    assert httpx.post(register, json={"n_rollouts": 4, "policy_version": -(2**63)}, timeout=30).status_code == 200
    reply = httpx.post(chat, json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "4", reply.text
    assert init(gateway, prompt_uid="widest", n_rollouts=2**32 - 1, policy_version=2**63 - 1)["trajectory_uid"]
