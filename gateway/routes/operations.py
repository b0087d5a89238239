"""Operations: ``/health``, ``/ready`` (503 with reasons until tokenizer, producer and a backend are
ready), ``/metrics``, ``/statistics`` (which instance, what it holds), ``/dashboard``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from trajbus.gateway.errors import RETRY_SECONDS, unavailable
from trajbus.gateway.http.dashboard import PAGE, DashboardData
from trajbus.gateway.service import GatewayService


def operations_router(service: GatewayService, admin: list) -> APIRouter:
    router = APIRouter()
    dashboard = DashboardData(service.kafka, service.settings.prefix, service.metrics, service.updates, service.pacing)

    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/ready")
    async def ready() -> JSONResponse:
        missing = service.readiness()
        if missing:  # the OpenAI error object too: every error body has one
            error = unavailable("; ".join(missing)).body()
            return JSONResponse({"ready": False, "reason": "; ".join(missing), "not_ready": missing, **error}, 503,
                                headers={"Retry-After": str(RETRY_SECONDS)})
        return JSONResponse({"ready": True})

    @router.get("/metrics")
    async def metrics() -> Response:
        for backend in service.backends.backends.values():
            service.metrics.backend_up.labels(backend.address).set(1 if backend.healthy else 0)
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/dashboard")
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text())

    @router.get("/dashboard/data")
    async def dashboard_data() -> dict[str, Any]:
        return await dashboard.get()

    @router.get("/statistics", dependencies=admin)
    async def statistics() -> dict[str, Any]:
        return service.statistics()

    return router
