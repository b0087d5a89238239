"""The trainer's weight update through the gateways: pause, load, publish, resume.

``PolicyVersionPublisher.update`` runs it: every gateway pauses (new engine calls
held, generations in flight cut at the engine, their sampled tokens kept), the
caller's ``load`` puts the new weights into the engines, the version is
published on ``{prefix}.policy`` (acknowledged), and every gateway resumes at
that version: each cut generation continues under the new weights, and its step
records which version sampled which tokens. If ``load`` or the publication
fails, the gateways resume at the version they served before (the cut
generations continue under the old weights), and the error is raised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import httpx


class UpdateFailed(RuntimeError):
    """A gateway refused a pause or a resume; the text names it and its answer."""


@dataclass
class UpdateReport:
    """What one update cost: generations cut (per gateway) and how long generation was paused."""

    version: int
    cut: dict[str, int] = field(default_factory=dict)
    paused_seconds: float = 0.0
    load_seconds: float = 0.0


class GatewayUpdates:
    """Pause and resume a set of gateways (``POST /admin/pause``, ``/admin/resume``)."""

    def __init__(self, gateways: Sequence[str], api_key: str | None = None, timeout: float = 120.0) -> None:
        self.gateways = [url.rstrip("/") for url in gateways]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=timeout)

    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(f"{url}{path}", json=body)
        if response.status_code != 200:
            raise UpdateFailed(f"{url}{path} answered {response.status_code}: {response.text[:500]}")
        return response.json()

    def run(self, version: int, load: Callable[[], object] | None, publish: Callable[[int], None],
            drain: bool = False) -> UpdateReport:
        report = UpdateReport(version)
        started = time.monotonic()
        before: dict[str, int | None] = {}
        try:
            for url in self.gateways:
                answer = self._post(url, "/admin/pause", {"drain": drain})
                report.cut[url], before[url] = answer["cut"], answer.get("serving")
            loading = time.monotonic()
            if load is not None:
                load()
            report.load_seconds = time.monotonic() - loading
            publish(version)
        except BaseException:
            for url, serving in before.items():  # back to the weights they had: cut generations continue
                if serving is not None:
                    self._post(url, "/admin/resume", {"version": serving})
            raise
        for url in self.gateways:
            self._post(url, "/admin/resume", {"version": version})
        report.paused_seconds = time.monotonic() - started
        return report

    def close(self) -> None:
        self.client.close()
