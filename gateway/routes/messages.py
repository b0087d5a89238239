"""Anthropic's Messages API on a black-box trajectory: ``POST {base_url}/v1/messages``.

Anthropic's SDK appends ``/v1/messages`` to its ``base_url``, so the ``base_url`` that
``/init_trajectory`` hands out serves both SDKs as it is: ``openai.OpenAI(base_url=...)``
calls ``{base_url}/chat/completions``, ``anthropic.Anthropic(base_url=...)``
``{base_url}/v1/messages``. The call is served by the chat completions pipeline
(``gateway.anthropic.messages``, ``gateway.anthropic.answers``). Its errors are
Anthropic's (``{"type": "error", "error": {"type", "message"}}``, the same statuses),
request validation included: the route's own class answers them, so no other route
pays for it. Answers the gateway's middleware gives before any route runs (413 for a
body over ``--max-body-bytes``, 503 while draining or shedding) keep OpenAI's body;
Anthropic's SDK reports them by their status all the same. The API key is not asked:
a ``base_url`` is its own capability (Anthropic's SDK sends its ``x-api-key``, ignored).
A client pointed at the gateway's root (``POST /v1/messages``) is answered 400, naming
``/init_trajectory``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Coroutine

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from trajbus.gateway.anthropic.answers import MessagesCall, error_response
from trajbus.gateway.anthropic.messages import conversation, engine_request
from trajbus.gateway.anthropic.schemas import MessagesRequest
from trajbus.gateway.errors import GatewayError, from_validation_error
from trajbus.gateway.http.lean_route import LeanJsonRoute
from trajbus.gateway.routes.paths import BASE, PAUSED
from trajbus.gateway.service import GatewayService
from trajbus.gateway.state.lifecycle import missing_trajectory
from trajbus.infra.tracing import TRACEPARENT

log = logging.getLogger("trajbus.gateway")

ROOT_MESSAGES = "/v1/messages"
MESSAGES = BASE + ROOT_MESSAGES


class AnthropicErrors(APIRoute):
    """A route whose errors are answered in Anthropic's shape (the app's handlers answer OpenAI's)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                error = from_validation_error(exc)
            except GatewayError as exc:
                error = exc
            except StarletteHTTPException as exc:
                error = GatewayError(exc.status_code, str(exc.detail))
            if error.status >= 500:
                log.warning("request failed path=%s status=%d error=%s", request.url.path, error.status,
                            error.message)
            return error_response(error)

        return answer


class LeanAnthropicRoute(AnthropicErrors, LeanJsonRoute):
    """The Messages route: served lean (``gateway.http.lean_route``), its errors in Anthropic's shape."""


def messages_router(service: GatewayService) -> APIRouter:
    router = APIRouter(route_class=AnthropicErrors)
    lifecycle, pacing = service.lifecycle, service.pacing
    chat = service.chat

    async def messages(trajectory_uid: str, prompt_uid: str, body: MessagesRequest, request: Request,
                       wait: float = Query(0.0, ge=0, le=service.settings.max_admission_wait, description=PAUSED)):
        trajectory = lifecycle.get(trajectory_uid, prompt_uid)
        pacing.touch(trajectory_uid)
        messages = conversation(body)
        call = await chat.prepare(trajectory, engine_request(body, messages), messages, wait, MessagesCall,
                                  traceparent=request.headers.get(TRACEPARENT))
        return await call.answer(bool(body.stream))

    router.add_api_route(MESSAGES, messages, methods=["POST"], route_class_override=LeanAnthropicRoute,
                         summary="Anthropic's Messages API (tool use, streaming) on a trajectory")

    @router.post(ROOT_MESSAGES, include_in_schema=False)  # no trajectory: serves nothing
    async def messages_without_trajectory() -> None:
        raise missing_trajectory(ROOT_MESSAGES, "Anthropic's Messages API")

    return router
