"""Black-box routes: ``/init_trajectory`` hands out ``base_url`` =
``{this instance's public url}/{trajectory_uid}/{prompt_uid}/v1``; under it an OpenAI
client calls ``chat/completions`` and ``models``, and the agent's harness
``register_trajectory`` and ``complete_trajectory``. A base_url is its own
capability; ``init_trajectory`` takes the API key when one is set. A client pointed at the
gateway's root as at vLLM (``http://HOST:8100/v1``) is answered 400 ``missing_trajectory``,
naming ``/init_trajectory`` (``ROOT_CALLS``)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Query, Request

from trajbus.gateway.http.lean_route import LeanJsonRoute
from trajbus.gateway.routes.paths import BASE, PAUSED, WAIT
from trajbus.gateway.schemas import (ChatCompletionRequest, CompleteTrajectoryRequest, InitTrajectoryRequest,
                                     RegisterTrajectoryRequest)
from trajbus.gateway.service import GatewayService
from trajbus.gateway.state.lifecycle import missing_trajectory
from trajbus.infra.tracing import TRACEPARENT

ROOT_CALLS = ("/v1/chat/completions", "/v1/completions", "/chat/completions")
"""Where an OpenAI client whose base_url is the gateway's root calls: no trajectory, so a 400 that says how to
get one (kept out of the schema: they serve nothing)."""


def blackbox_router(service: GatewayService, admin: list) -> APIRouter:
    router = APIRouter()
    settings, lifecycle, pacing = service.settings, service.lifecycle, service.pacing
    chat = service.chat

    async def chat_completions(trajectory_uid: str, prompt_uid: str, body: ChatCompletionRequest, request: Request,
                               wait: float = Query(0.0, ge=0, le=settings.max_admission_wait, description=PAUSED)):
        trajectory = lifecycle.get(trajectory_uid, prompt_uid)
        pacing.touch(trajectory_uid)
        return await chat.create(trajectory, body, wait, request.headers.get(TRACEPARENT))

    router.add_api_route(BASE + "/chat/completions", chat_completions, methods=["POST"],
                         route_class_override=LeanJsonRoute)  # the hot route: served lean, matched first

    @router.post("/init_trajectory", dependencies=admin)
    async def init_trajectory(body: InitTrajectoryRequest | None = None,
                              wait: float = Query(0.0, ge=0, le=settings.max_admission_wait, description=WAIT)
                              ) -> dict[str, Any]:
        body = body or InitTrajectoryRequest()
        trajectory = await lifecycle.init(body.prompt_uid, body.channel, body.n_rollouts, body.metadata,
                                          body.policy_version, wait)
        base_url = (f"{settings.base_address}/{trajectory.trajectory_uid}/"
                    f"{quote(trajectory.prompt_uid, safe='')}/v1")
        return {"trajectory_uid": trajectory.trajectory_uid, "prompt_uid": trajectory.prompt_uid,
                "channel": trajectory.channel, "base_url": base_url, "instance": settings.instance}

    async def without_trajectory(request: Request) -> None:
        raise missing_trajectory(request.url.path, "chat completions")

    for path in ROOT_CALLS:
        router.add_api_route(path, without_trajectory, methods=["POST"], include_in_schema=False)

    @router.post(BASE + "/register_trajectory")
    async def register_trajectory(trajectory_uid: str, prompt_uid: str,
                                  body: RegisterTrajectoryRequest | None = None) -> dict[str, Any]:
        body = body or RegisterTrajectoryRequest()
        trajectory = await lifecycle.register(lifecycle.get(trajectory_uid, prompt_uid), body.channel,
                                        body.n_rollouts, body.metadata, body.policy_version)
        return {"trajectory_uid": trajectory.trajectory_uid, "prompt_uid": trajectory.prompt_uid,
                "channel": trajectory.channel, "n_rollouts": trajectory.n_rollouts,
                "policy_version": trajectory.policy_version, "next_step": trajectory.next_step}

    @router.get(BASE + "/models")
    async def models(trajectory_uid: str, prompt_uid: str) -> dict[str, Any]:
        lifecycle.get(trajectory_uid, prompt_uid, open_only=False)
        return {"object": "list", "data": [{"id": settings.served_model_name, "object": "model",
                                            "owned_by": "trajbus"}]}

    @router.post(BASE + "/complete_trajectory")
    async def complete_trajectory(trajectory_uid: str, prompt_uid: str,
                                  body: CompleteTrajectoryRequest | None = None) -> dict[str, Any]:
        body = body or CompleteTrajectoryRequest()
        trajectory = lifecycle.get(trajectory_uid, prompt_uid, open_only=False)  # 409 comes from complete
        reward, done = await lifecycle.complete(trajectory, body.reward, body.metadata)
        return {"trajectory_uid": trajectory_uid, "prompt_uid": prompt_uid, "reward": reward,
                "steps": done.published_steps, "step_indices": done.acknowledged}

    return router
