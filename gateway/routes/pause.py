"""Weight-update routes (``gateway.engine.updates``): ``POST /admin/pause`` holds new engine calls and cuts the
generations in flight, ``POST /admin/resume`` continues them under the version it names, ``GET
/admin/pause`` says where an update stands. All take the API key when one is set."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from trajbus.gateway.schemas import PauseRequest, ResumeRequest
from trajbus.gateway.service import GatewayService


def pause_router(service: GatewayService, admin: list) -> APIRouter:
    router = APIRouter(dependencies=admin)
    gate = service.updates

    @router.post("/admin/pause")
    async def pause(body: PauseRequest | None = None) -> dict[str, Any]:
        return await gate.pause((body or PauseRequest()).drain)

    @router.post("/admin/resume")
    async def resume(body: ResumeRequest) -> dict[str, Any]:
        return gate.resume(body.version)

    @router.get("/admin/pause")
    async def state() -> dict[str, Any]:
        return gate.state()

    return router
