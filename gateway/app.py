"""The gateway's HTTP routes: operations, white-box, black-box.

Operations: ``/ready`` (503 with reasons until tokenizer, producer and a
backend are ready), ``/health``, ``/metrics``, ``/statistics``, ``/dashboard``.
White-box: ``/generate``, ``/submit_steps?channel=``, ``/compute_reward``.
Black-box: ``/init_trajectory`` hands out ``base_url`` =
``{public url}/{trajectory_uid}/{prompt_uid}/v1``; under it an OpenAI client
calls ``chat/completions``, and the agent's harness ``register_trajectory`` and
``complete_trajectory``. White-box and admin routes take ``--api-key`` as a
bearer token when one is set; a black-box URL is its own capability.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trajbus.gateway.backends import BackendError, NoBackendAvailable
from trajbus.gateway.chat import ChatCompletions, backend_failure, check_prompt_length
from trajbus.gateway.config import GatewaySettings
from trajbus.gateway.dashboard import PAGE, DashboardData
from trajbus.gateway.errors import (RETRY_SECONDS, GatewayError, bad_request, from_validation_error,
                                    install_error_handlers, unavailable)
from trajbus.gateway.openapi import describe
from trajbus.gateway.schemas import (CHANNEL_PATTERN, ChatCompletionRequest, CompleteTrajectoryRequest,
                                     GenerateRequest, InitTrajectoryRequest, RegisterTrajectoryRequest,
                                     RewardRequest, SubmitStepsRequest, step_from_json,
                                     submit_steps_schema)
from trajbus.gateway.service import GatewayService
from trajbus.streams.records import Step

log = logging.getLogger("trajbus.gateway")

WAIT = "seconds a new trajectory may be held until admitted (pacing), else 429 at once"
BEARER = HTTPBearer(auto_error=False, description="--api-key, when the gateway has one")
"""Declares the API key in the OpenAPI schema; ``require_api_key`` answers 401 itself (OpenAI-shaped)."""


async def json_body(request: Request) -> Any:
    """The request body as JSON, for a route that checks it itself; 400 when it is not JSON."""
    try:
        return json.loads(await request.body())
    except ValueError as exc:  # UnicodeDecodeError included
        raise bad_request(f"body: invalid JSON ({exc})", param="body") from None


SUBMIT_STEPS_BODY = {"requestBody": {"required": True,
                                     "content": {"application/json": {"schema": submit_steps_schema()}}}}
"""``/submit_steps`` reads its body itself, so the schema of its steps is declared here."""


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


class BodySizeLimit:
    """413 for request bodies over the cap, declared (Content-Length) or streamed (chunked).

    A chunked body is read here first, up to the cap, then handed on: the
    framework never sees a body it would have to fail on mid-parse.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._reject(send)
            return await self.app(scope, receive, send)
        messages: list[Message] = []
        received = 0
        while True:
            message = await receive()
            messages.append(message)
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                return await self._reject(send)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send) -> None:
        error = GatewayError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
        response = error.response()
        await response({"type": "http"}, None, send)  # type: ignore[arg-type]


def create_app(settings: GatewaySettings) -> FastAPI:
    service = GatewayService(settings)
    chat = ChatCompletions(service)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await service.start()
        yield
        await service.close()

    app = FastAPI(title="trajbus gateway", lifespan=lifespan)
    app.state.service = service
    install_error_handlers(app)
    describe(app, settings, lambda: len(service.tokenizer.tokenizer) if service.tokenizer.ready else None)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    @app.middleware("http")
    async def observe(request: Request, call_next):
        started = time.monotonic()
        response = await call_next(request)
        route = getattr(request.scope.get("route"), "path", "unmatched")
        service.metrics.requests.labels(route, str(response.status_code)).inc()
        service.metrics.latency.labels(route).observe(time.monotonic() - started)
        if response.status_code >= 400 and route != "/ready":  # 503 while starting is expected
            log.info("request method=%s route=%s status=%d ms=%.1f", request.method, route,
                     response.status_code, 1000 * (time.monotonic() - started))
        return response

    def require_api_key(credentials: HTTPAuthorizationCredentials | None = Depends(BEARER)) -> None:
        if settings.api_key is None:
            return
        token = credentials.credentials if credentials is not None else ""
        if not secrets.compare_digest(token.encode(), settings.api_key.encode()):
            raise GatewayError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                               type_="authentication_error", code="invalid_api_key")

    admin = [Depends(require_api_key)]

    # -- operations ---------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        missing = service.readiness()
        if missing:  # the OpenAI error object too: every error body has one
            error = unavailable("; ".join(missing)).body()
            return JSONResponse({"ready": False, "reason": "; ".join(missing), "not_ready": missing, **error}, 503,
                                headers={"Retry-After": str(RETRY_SECONDS)})
        return JSONResponse({"ready": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        for backend in service.backends.backends.values():
            service.metrics.backend_up.labels(backend.address).set(1 if backend.healthy else 0)
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    dashboard = DashboardData(service)

    @app.get("/dashboard")
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text())

    @app.get("/dashboard/data")
    async def dashboard_data() -> dict[str, Any]:
        return await dashboard.get()

    @app.get("/statistics", dependencies=admin)
    async def statistics() -> dict[str, Any]:
        return service.statistics()

    # -- white-box ----------------------------------------------------------------
    @app.post("/generate", dependencies=admin)
    async def generate(body: GenerateRequest, wait: float = Query(0.0, ge=0, le=settings.max_admission_wait,
                                                                  description=WAIT)) -> dict[str, Any]:
        service.require("backend")
        check_prompt_length(body.prompt_ids, settings.prompt_length, what="prompt_ids")
        uid = body.trajectory_uid
        if uid is not None and uid not in service.admission.admitted and not body.step_index:
            await service.admit(uid, service.channel(body.channel), body.prompt_uid or uid, body.policy_version, wait)
        elif uid is not None:
            service.admission.touch(uid)
        try:
            backend, completions = await service.backends.complete(
                body.prompt_ids, body.engine_params(settings.response_length),
                preferred=service.backends.remembered(body.trajectory_uid))
        except (NoBackendAvailable, BackendError) as exc:
            raise backend_failure(exc) from None
        service.backends.remember(body.trajectory_uid, backend)
        choices = [{"index": c.index, "response_ids": c.token_ids, "log_probs": c.logprobs,
                    "finish_reason": c.finish_reason, "text": c.text} for c in completions]
        first = choices[0]
        return {"response_ids": first["response_ids"], "log_probs": first["log_probs"],
                "finish_reason": first["finish_reason"], "text": first["text"], "choices": choices,
                "backend": backend}

    @app.post("/submit_steps", dependencies=admin, openapi_extra=SUBMIT_STEPS_BODY)
    async def submit_steps(request: Request, channel: str = Query(settings.default_channel, pattern=CHANNEL_PATTERN)
                           ) -> dict[str, Any]:
        steps, n_rollouts = submitted_steps(await json_body(request))
        count = await service.publish(steps, channel, "submit_steps", n_rollouts)
        for step in steps:
            if step.is_last:  # a white-box trajectory is finished: it leaves the backlog's in-flight count
                service.admission.release(step.trajectory_uid)
        return {"published": count, "channel": channel}

    @app.post("/compute_reward", dependencies=admin)
    async def compute_reward(body: RewardRequest) -> dict[str, float]:
        return {"reward": await service.score(body.model_dump())}

    # -- black-box ----------------------------------------------------------------
    @app.post("/init_trajectory", dependencies=admin)
    async def init_trajectory(body: InitTrajectoryRequest | None = None,
                              wait: float = Query(0.0, ge=0, le=settings.max_admission_wait, description=WAIT)
                              ) -> dict[str, Any]:
        body = body or InitTrajectoryRequest()
        trajectory = await service.init_trajectory(body.prompt_uid, body.channel, body.n_rollouts, body.metadata,
                                                   body.policy_version, wait)
        base_url = (f"{settings.base_address}/{trajectory.trajectory_uid}/"
                    f"{quote(trajectory.prompt_uid, safe='')}/v1")
        return {"trajectory_uid": trajectory.trajectory_uid, "prompt_uid": trajectory.prompt_uid,
                "channel": trajectory.channel, "base_url": base_url}

    base = "/{trajectory_uid}/{prompt_uid:path}/v1"

    @app.post(base + "/register_trajectory")
    async def register_trajectory(trajectory_uid: str, prompt_uid: str,
                                  body: RegisterTrajectoryRequest | None = None) -> dict[str, Any]:
        body = body or RegisterTrajectoryRequest()
        trajectory = service.register(service.trajectory(trajectory_uid, prompt_uid), body.channel,
                                      body.n_rollouts, body.metadata, body.policy_version)
        return {"trajectory_uid": trajectory.trajectory_uid, "prompt_uid": trajectory.prompt_uid,
                "channel": trajectory.channel, "n_rollouts": trajectory.n_rollouts,
                "policy_version": trajectory.policy_version, "next_step": trajectory.next_step}

    @app.post(base + "/chat/completions")
    async def chat_completions(trajectory_uid: str, prompt_uid: str, body: ChatCompletionRequest):
        trajectory = service.trajectory(trajectory_uid, prompt_uid)
        service.admission.touch(trajectory_uid)
        return await chat.create(trajectory, body)

    @app.get(base + "/models")
    async def models(trajectory_uid: str, prompt_uid: str) -> dict[str, Any]:
        service.trajectory(trajectory_uid, prompt_uid, open_only=False)
        return {"object": "list", "data": [{"id": settings.served_model_name, "object": "model",
                                            "owned_by": "trajbus"}]}

    @app.post(base + "/complete_trajectory")
    async def complete_trajectory(trajectory_uid: str, prompt_uid: str,
                                  body: CompleteTrajectoryRequest | None = None) -> dict[str, Any]:
        body = body or CompleteTrajectoryRequest()
        trajectory = service.trajectory(trajectory_uid, prompt_uid, open_only=False)  # 409 comes from complete
        reward, done = await service.complete(trajectory, body.reward, body.metadata)
        return {"trajectory_uid": trajectory_uid, "prompt_uid": prompt_uid, "reward": reward,
                "steps": done.published_steps, "step_indices": done.acknowledged}

    return app
