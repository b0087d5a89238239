"""The gateway's /dashboard in headless Chromium while groups flow: the numbers move; a screenshot is kept."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from pathlib import Path

import httpx

from trajbus.streams.client.producer import StepProducer
from tests.helpers import wait_for

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def browse(url: str, *args: str) -> str:
    assert CHROMIUM, "headless Chromium is needed (`make browser` installs Debian's chromium)"
    result = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=4000",
                             *args, url], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def shown(url: str) -> dict[str, str]:
    """The dashboard's numbers, as its JavaScript rendered them."""
    dom = browse(url, "--dump-dom")
    return dict(re.findall(r'id="([a-z-]+)">([^<]*)<', dom))


def test_dashboard_numbers_move_while_groups_flow(bootstrap_servers, prefix, inference_server, start_gateway,
                                                  start_worker):
    gateway, _ = start_gateway([inference_server])
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
    start_worker(n_rollouts=2)
    stop = threading.Event()

    def agents() -> None:  # white-box agents submitting finished groups of two trajectories, version 1
        g = 0
        while not stop.is_set():
            steps = [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "trajectory_uid": f"g{g}-t{t}",
                      "prompt_uid": f"g{g}", "is_last": True, "reward": float(t), "policy_version": 1}
                     for t in range(2)]
            httpx.post(f"{gateway}/submit_steps", json={"steps": steps, "n_rollouts": 2}).raise_for_status()
            g += 1
            stop.wait(0.1)  # pacing, so the dashboard sees a stream rather than one burst

    flow = threading.Thread(target=agents, daemon=True)
    flow.start()
    try:
        url = f"{gateway}/dashboard"
        first = wait_for(lambda: (s := shown(url)).get("groups-emitted", "-") not in ("-", "0") and s, 90,
                         "the dashboard to show emitted groups")
        published = int(first["steps-total"])
        wait_for(lambda: httpx.get(f"{gateway}/statistics").json()["steps_published"]["train/submit_steps"]
                 >= published + 20, 60, "20 more steps")
        # The worker's counts reach the dashboard with its next statistics snapshot (every 2 s).
        second = wait_for(lambda: (s := shown(url)).get("groups-emitted", "-") not in ("-", "0")
                          and int(s["groups-emitted"]) > int(first["groups-emitted"]) and s, 60,
                          "more emitted groups on the dashboard")
        ARTIFACTS.mkdir(exist_ok=True)
        screenshot = ARTIFACTS / "dashboard.png"
        screenshot.unlink(missing_ok=True)
        browse(url, f"--screenshot={screenshot}", "--window-size=1200,1000")
    finally:
        stop.set()
        flow.join(10)
    assert int(second["steps-total"]) >= published + 20
    assert int(second["groups-emitted"]) > int(first["groups-emitted"])
    assert float(second["throughput"]) > 0
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = httpx.get(f"{gateway}/dashboard/data").json()
    assert data["rewards"]["1"]["count"] > 0 and data["rewards"]["1"]["mean"] == 0.5
