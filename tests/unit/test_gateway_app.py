"""The gateway's ASGI application: answers without deprecation warnings (start-up and first calls are quiet),
a client pointed at its root told how to get a base_url, ``/ready`` saying what it waits for."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from fastapi import FastAPI
from starlette.testclient import TestClient

from trajbus.gateway.app import create_app
from trajbus.gateway.config import add_gateway_arguments, settings_from_args
from trajbus.gateway.http.responses import OrjsonResponse


def app_at(state_dir: Path) -> FastAPI:
    """A gateway's application without its lifespan: nothing connects, the routes answer all the same."""
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    return create_app(settings_from_args(parser.parse_args(["--vllm-addresses", "127.0.0.1:1", "--tokenizer-path",
                                                            "unused", "--state-dir", str(state_dir)])))


def test_answers_are_orjson_and_raise_no_deprecation_warning(tmp_path):
    app = app_at(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        health = TestClient(app).get("/health")  # a route's return value, encoded by the default class
        answer = OrjsonResponse({"id": "chatcmpl-1", 1: "non-string key"})  # what chat completions answer
    assert health.status_code == 200 and health.headers["content-type"] == "application/json"
    assert answer.body == b'{"id":"chatcmpl-1","1":"non-string key"}'
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []  # FastAPI's is a UserWarning


def test_engine_calls_at_the_root_name_init_trajectory_in_their_apis_error_shape(tmp_path):
    """An OpenAI client at ``http://HOST:8100/v1`` (as at vLLM), an Anthropic one at the root: 400
    missing_trajectory saying how to get a base_url, whatever the body; none of these paths is in the schema."""
    app = app_at(tmp_path)
    client = TestClient(app)
    for path in ("/v1/chat/completions", "/v1/completions", "/chat/completions"):
        answer = client.post(path, json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
        error = answer.json()["error"]
        assert answer.status_code == 400 and set(answer.json()) == {"error"}, (path, answer.text)
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "missing_trajectory", None)
        assert error["message"].startswith(f"POST {path} names no trajectory: this gateway serves chat completions "
                                           'per trajectory: POST /init_trajectory {"prompt_uid": ...} and use the '
                                           "base_url it returns as the client's base_url"), error
    answer = client.post("/v1/messages", content=b"not even JSON")
    assert answer.status_code == 400 and answer.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "POST /v1/messages names no trajectory: this gateway serves Anthropic's Messages API per "
                   'trajectory: POST /init_trajectory {"prompt_uid": ...} and use the base_url it returns as the '
                   "client's base_url"}}
    paths = app.openapi()["paths"]
    assert not {"/v1/chat/completions", "/v1/completions", "/chat/completions", "/v1/messages"} & set(paths)


def test_ready_says_what_it_waits_for(tmp_path):
    ready = TestClient(app_at(tmp_path)).get("/ready")  # never started: the tokenizer loads, nothing answers
    assert ready.status_code == 503 and ready.headers["retry-after"]
    assert ready.json()["not_ready"] == [
        "loading the tokenizer from unused", "connecting to Kafka",
        "no inference backend answers: none of http://127.0.0.1:1 (--vllm-addresses) passes its health check "
        "or answers its calls"], ready.json()


def test_the_lean_engine_routes_refuse_as_fastapi_did_before_looking_up_the_trajectory(tmp_path):
    """Chat completions and Anthropic's messages are served without FastAPI's dependency solving
    (``gateway.http.lean_route``): a body or ``wait`` they refuse is 400 naming the field (in each API's shape),
    checked before the trajectory (unknown here: 404 only once the request is valid), and the schema still
    declares the body and the query."""
    app = app_at(tmp_path)
    client = TestClient(app)
    url = "/no-such-trajectory/a%2Fprompt/v1/chat/completions"
    hello = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    refused = {"invalid JSON": (client.post(url, content=b"{not json"), "body", "body: invalid JSON ("),
               "no messages": (client.post(url, json={"messages": []}), "messages",
                               "messages: List should have at least 1 item"),
               "a bad role": (client.post(url, json={"messages": [{"role": "robot", "content": "x"}]}),
                              "messages.0.role", "messages.0.role: Input should be"),
               "a negative wait": (client.post(f"{url}?wait=-1", json=hello), "wait",
                                   "wait: Input should be greater than or equal to 0")}
    for case, (answer, param, message) in refused.items():
        error = answer.json()["error"]
        assert (answer.status_code, error["type"], error["param"]) == (400, "invalid_request_error", param), case
        assert error["message"].startswith(message), (case, error)
    unknown = client.post(f"{url}?wait=1", json=hello)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found", unknown.text
    operation = app.openapi()["paths"]["/{trajectory_uid}/{prompt_uid}/v1/chat/completions"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"} and operation["requestBody"]["required"]
    wait = next(p for p in operation["parameters"] if p["name"] == "wait")
    assert wait["in"] == "query" and wait["schema"]["maximum"] == 120.0, wait
    anthropic = client.post("/no-such-trajectory/p/v1/v1/messages?wait=-1", json={"messages": []})
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error", anthropic.text  # Anthropic's shape
    assert anthropic.json()["error"]["message"].startswith("wait: Input should be"), anthropic.text


def test_the_lean_routes_are_served_before_the_frameworks_router_and_counted_by_their_template(tmp_path, monkeypatch):
    """``LeanRoutes`` serves chat completions and Anthropic's messages itself: no FastAPI route handles them (its
    ``APIRoute.handle`` fails here), yet each answers as before: the app's handler for an unknown trajectory
    (404 in OpenAI's shape, the query's defaults taken without a query string), Anthropic's shape on its route,
    the request counted under its route template. Another method on the same path is the framework's (405)."""
    from fastapi.routing import APIRoute

    def not_here(*_args):
        raise AssertionError("a lean route reached FastAPI's router")

    app = app_at(tmp_path)
    client = TestClient(app)
    monkeypatch.setattr(APIRoute, "handle", not_here)
    hello = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    for query in ("", "?wait=0.5"):
        unknown = client.post(f"/no-such-trajectory/a%2Fprompt/v1/chat/completions{query}", json=hello)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found", unknown.text
    anthropic = client.post("/no-such-trajectory/p/v1/v1/messages", json={"messages": []})
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error", anthropic.text
    monkeypatch.undo()
    assert client.get("/no-such-trajectory/p/v1/chat/completions").status_code == 405
    counted = client.get("/metrics").text
    assert 'trajbus_gateway_requests_total{route="/{trajectory_uid}/{prompt_uid:path}/v1/chat/completions",' \
           'status="404"} 2.0' in counted, counted
