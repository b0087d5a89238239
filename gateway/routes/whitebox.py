"""White-box routes: ``/generate`` (token ids in, sampled ids and log-probs out, with the versions that
sampled them when a weight update cut the generation: ``gateway.engine.generation``), ``/submit_steps`` (the
agent's own steps, acknowledged), ``/compute_reward``. All take the API key when one is set."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Query, Request
from pydantic import ValidationError

from trajbus.gateway.errors import bad_request, from_validation_error
from trajbus.gateway.routes.paths import PAUSED, WAIT
from trajbus.gateway.schemas import (CHANNEL_PATTERN, GenerateRequest, RewardRequest, SubmitStepsRequest,
                                     step_from_json, submit_steps_schema)
from trajbus.gateway.service import GatewayService
from trajbus.streams.wire.records import Step

SUBMIT_STEPS_BODY = {"requestBody": {"required": True,
                                     "content": {"application/json": {"schema": submit_steps_schema()}}}}
"""``/submit_steps`` reads its body itself, so the schema of its steps is declared here."""


async def json_body(request: Request) -> Any:
    """The request body as JSON, for a route that checks it itself; 400 when it is not JSON."""
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:  # invalid UTF-8 included
        raise bad_request(f"body: invalid JSON ({exc})", param="body") from None


def submitted_steps(body: Any) -> tuple[list[Step], int | None]:
    """``/submit_steps``'s body, bare steps or ``{"steps", "n_rollouts"}``, as checked steps and the group
    size; 400 naming the first bad field. Steps are checked by ``Step.from_dict``, at C speed for token
    lists (a model would build a Python object per token)."""
    if isinstance(body, dict):
        try:
            wrapped = SubmitStepsRequest.model_validate(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        raw, n_rollouts = wrapped.steps, wrapped.n_rollouts
    elif isinstance(body, list):
        raw, n_rollouts = body, None
    else:
        raise bad_request('body: expected a list of steps or {"steps": [...], "n_rollouts": n}', param="body")
    if not raw:
        raise bad_request("steps: at least one step is required", param="steps")
    steps = []
    for position, data in enumerate(raw):
        try:
            steps.append(step_from_json(data))
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            raise bad_request(f"steps[{position}].{exc}", param=f"steps[{position}].{field}") from None
    return steps, n_rollouts


def whitebox_router(service: GatewayService, admin: list) -> APIRouter:
    router = APIRouter(dependencies=admin)
    settings, engine, backends, lifecycle = service.settings, service.engine, service.backends, service.lifecycle

    @router.post("/generate")
    async def generate(body: GenerateRequest, wait: float = Query(0.0, ge=0, le=settings.max_admission_wait,
                                                                  description=f"{WAIT}; {PAUSED}")) -> dict[str, Any]:
        service.require("backend")
        engine.check_length(body.prompt_ids, what="prompt_ids")
        uid = body.trajectory_uid
        await lifecycle.admit_generation(uid, body.prompt_uid, body.channel, body.step_index, body.policy_version,
                                         wait)
        sampling = body.engine_params(settings.response_length)
        await engine.hold(wait)  # then the version: a call held through an update is stamped with the new one
        version = body.policy_version if body.policy_version is not None else service.served.stamp(body.channel)
        generation = engine.generation(body.prompt_ids, sampling, version, backends.remembered(uid), stream=False)
        await engine.run(generation)
        backends.remember(uid, generation.backend)
        choices = [{"index": c.index, "response_ids": c.token_ids, "log_probs": c.logprobs,
                    "finish_reason": c.finish_reason, "text": c.text,
                    "version_segments": c.segments.wire(version)} for c in generation.choices]
        first = choices[0]
        return {"response_ids": first["response_ids"], "log_probs": first["log_probs"],
                "finish_reason": first["finish_reason"], "text": first["text"], "choices": choices,
                "backend": generation.backend, "policy_version": version,
                "version_segments": first["version_segments"]}

    @router.post("/submit_steps", openapi_extra=SUBMIT_STEPS_BODY)
    async def submit_steps(request: Request, channel: str = Query(settings.default_channel, pattern=CHANNEL_PATTERN)
                           ) -> dict[str, Any]:
        steps, n_rollouts = submitted_steps(await json_body(request))
        count, channel = await lifecycle.submit(steps, channel, n_rollouts)
        return {"published": count, "channel": channel}

    @router.post("/compute_reward")
    async def compute_reward(body: RewardRequest) -> dict[str, float]:
        return {"reward": await service.rewards.answer(body.model_dump())}

    return router
