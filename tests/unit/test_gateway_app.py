"""The gateway's ASGI application answers without deprecation warnings (start-up and first calls are quiet)."""

from __future__ import annotations

import argparse
import warnings

from starlette.testclient import TestClient

from trajbus.gateway.app import create_app
from trajbus.gateway.config import add_gateway_arguments, settings_from_args
from trajbus.gateway.responses import OrjsonResponse


def test_answers_are_orjson_and_raise_no_deprecation_warning(tmp_path):
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    settings = settings_from_args(parser.parse_args(["--vllm-addresses", "127.0.0.1:1", "--tokenizer-path", "unused",
                                                     "--state-dir", str(tmp_path)]))
    app = create_app(settings)  # no lifespan: nothing connects, the routes answer all the same
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        health = TestClient(app).get("/health")  # a route's return value, encoded by the default class
        answer = OrjsonResponse({"id": "chatcmpl-1", 1: "non-string key"})  # what chat completions answer
    assert health.status_code == 200 and health.headers["content-type"] == "application/json"
    assert answer.body == b'{"id":"chatcmpl-1","1":"non-string key"}'
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []  # FastAPI's is a UserWarning
