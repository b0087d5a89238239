"""The gateway's ASGI application: its parts (``GatewayService``), its routers, its middleware.

Operations (``gateway.routes.operations``), white-box (``...whitebox``),
black-box (``...blackbox``; Anthropic's Messages API: ``...messages``) and weight-update (``...pause``)
routes; white-box and admin routes take ``--api-key`` as a bearer token when one is set, a black-box URL is its
own capability. Responses are encoded by orjson (``gateway.http.responses``: faster than FastAPI's own).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from trajbus.gateway.config import GatewaySettings
from trajbus.gateway.errors import install_error_handlers
from trajbus.gateway.http.lean_route import LeanJsonRoute, LeanRoutes
from trajbus.gateway.http.middleware import BodySizeLimit, CallLimit, Drain, RequestObserver
from trajbus.gateway.http.openapi import describe
from trajbus.gateway.http.responses import OrjsonResponse
from trajbus.gateway.routes.auth import api_key_guard
from trajbus.gateway.routes.blackbox import blackbox_router
from trajbus.gateway.routes.messages import messages_router
from trajbus.gateway.routes.operations import operations_router
from trajbus.gateway.routes.pause import pause_router
from trajbus.gateway.routes.whitebox import whitebox_router
from trajbus.gateway.service import GatewayService


def create_app(settings: GatewaySettings) -> FastAPI:
    service = GatewayService(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await service.start()
        yield
        await service.close()

    # FastAPI's own OpenTelemetry (a server span per request once a tracer is set, looked up at every request) is
    # off: a call's spans are the gateway's (``--tracing``, ``gateway.chat.call_spans``), in the agent's trace.
    app = FastAPI(title="trajbus gateway", lifespan=lifespan, default_response_class=OrjsonResponse,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.service = service
    install_error_handlers(app)
    describe(app, settings, lambda: len(service.tokenizer.tokenizer) if service.tokenizer.ready else None)
    admin = api_key_guard(settings.api_key)
    routers = (blackbox_router(service, admin), messages_router(service), operations_router(service, admin),
               whitebox_router(service, admin), pause_router(service, admin))
    for router in routers:
        app.include_router(router)
    # Outermost last: every request is observed, a shed or drained one too; the body cap applies before any parse;
    # the hot routes are served before the framework's router (``gateway.http.lean_route``).
    app.add_middleware(LeanRoutes, routes=[route for router in routers for route in router.routes
                                           if isinstance(route, LeanJsonRoute)], handlers=app.exception_handlers)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(CallLimit, limit=settings.max_concurrent_calls, metrics=service.metrics,
                       quiet=service.upkeep)
    app.add_middleware(Drain, draining=lambda: service.draining)
    app.add_middleware(RequestObserver, metrics=service.metrics)
    return app
