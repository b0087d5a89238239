"""The gateway's OpenAPI schema states what its routes accept: integer widths, limits, errors, the API key."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from trajbus.gateway.app import create_app
from trajbus.gateway.config import add_gateway_arguments, settings_from_args
from trajbus.gateway.schemas import step_from_json


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    args = parser.parse_args(["--vllm-addresses", "127.0.0.1:1", "--tokenizer-path", "unused", "--api-key", "k",
                              "--state-dir", str(tmp_path_factory.mktemp("state")), "--response-length", "64",
                              "--prompt-length", "512"])
    return create_app(settings_from_args(args)).openapi()


def integer(models: dict[str, Any], model: str, name: str) -> dict[str, Any]:
    field = models[model]["properties"][name]
    return next(s for s in field.get("anyOf", [field]) if s.get("type") == "integer")


def test_integers_are_bounded_by_their_width_in_storage_and_on_the_wire(schema):
    models = schema["components"]["schemas"]
    for model in ("InitTrajectoryRequest", "RegisterTrajectoryRequest"):
        assert integer(models, model, "n_rollouts")["exclusiveMaximum"] == 2**32
        version = integer(models, model, "policy_version")
        assert (version["minimum"], version["exclusiveMaximum"]) == (-(2**63), 2**63)
    assert integer(models, "GenerateRequest", "step_index")["exclusiveMaximum"] == 2**32
    assert models["GenerateRequest"]["properties"]["prompt_ids"]["items"]["exclusiveMaximum"] == 2**32
    for model in ("GenerateRequest", "ChatCompletionRequest"):
        assert integer(models, model, "max_tokens")["maximum"] == 64  # --response-length
        assert integer(models, model, "seed")["exclusiveMaximum"] == 2**63
    assert models["GenerateRequest"]["properties"]["prompt_ids"]["maxItems"] == 512  # --prompt-length


def test_init_trajectory_requires_the_prompt_uid(schema):
    """The rollouts of one prompt share it: the schema says it is required (the route says why, in its 400)."""
    init = schema["components"]["schemas"]["InitTrajectoryRequest"]
    assert init["required"] == ["prompt_uid"]
    assert "rollouts of one prompt" in init["properties"]["prompt_uid"]["description"]


def test_submit_steps_declares_the_step_record(schema):
    operation = schema["paths"]["/submit_steps"]["post"]
    wrapped, bare = operation["requestBody"]["content"]["application/json"]["schema"]["anyOf"]
    step = bare["items"]
    assert wrapped["properties"]["steps"] == bare
    assert set(step["required"]) == {"prompt_ids", "response_ids", "trajectory_uid", "prompt_uid"}
    assert step["additionalProperties"] is False
    assert step["properties"]["step_index"]["exclusiveMaximum"] == 2**32


def test_errors_are_openai_shaped_and_white_box_routes_take_the_api_key(schema):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
            assert operation["responses"]["4XX"]["content"]["application/json"]["schema"] == \
                {"$ref": "#/components/schemas/Error"}
    for path in ("/generate", "/submit_steps", "/compute_reward", "/init_trajectory"):
        assert schema["paths"][path]["post"]["security"] == [{"HTTPBearer": []}], path
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_a_step_in_json_may_write_integers_as_integral_numbers():
    step = step_from_json({"prompt_ids": [1.0, 2], "response_ids": [3.0], "trajectory_uid": "t",
                           "prompt_uid": "p", "step_index": 2.0, "policy_version": -1.0})
    assert (step.prompt_ids, step.response_ids, step.step_index, step.policy_version) == ([1, 2], [3], 2, -1)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\]"):
        step_from_json({"prompt_ids": [1.5], "response_ids": [], "trajectory_uid": "t", "prompt_uid": "p"})
    with pytest.raises(ValueError, match="created_at"):  # the record's timestamp: int64 milliseconds
        step_from_json({"prompt_ids": [1], "response_ids": [2], "trajectory_uid": "t", "prompt_uid": "p",
                        "created_at": 1.6e133})
