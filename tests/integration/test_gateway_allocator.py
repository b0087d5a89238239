"""The gateway's C allocator: ``trajbus gateway`` as a user types it starts itself again on mimalloc (the same
process, so a supervisor's pid stays right) and serves; ``--allocator system`` runs on the C library's malloc,
even when started with mimalloc preloaded."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from trajbus.infra.allocator import MIMALLOC, SYSTEM, mimalloc_library, preloaded
from trajbus.pipelines.processes import ServiceProcess, free_port, wait_http


def maps_mimalloc(pid: int) -> bool:
    """Whether the wheel's mimalloc library is mapped into the process."""
    return mimalloc_library() in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("allocator, preload", [(MIMALLOC, False), (SYSTEM, True)])
def test_a_gateway_runs_on_its_allocator_whatever_it_was_started_with_and_serves(
        allocator, preload, bootstrap_servers, prefix, scripted_engine, tiny_model_dir, tmp_path):
    engine, _ = scripted_engine(["Done."])
    port = free_port()
    gateway = ServiceProcess(
        ["gateway", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--vllm-addresses", engine,
         "--tokenizer-path", str(tiny_model_dir), "--port", str(port), "--state-dir", str(tmp_path / "state"),
         "--drain-delay", "0", "--allocator", allocator],
        tmp_path / "gateway.log", env=preloaded(os.environ, preload)).start()  # the other one: the gateway switches
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/ready", 120, gateway)
        assert maps_mimalloc(gateway.pid) == (allocator == MIMALLOC), gateway.log_tail()
        base_url = httpx.post(f"{url}/init_trajectory", json={"prompt_uid": "p", "n_rollouts": 1}).json()["base_url"]
        answer = httpx.post(f"{base_url}/chat/completions", timeout=30,
                            json={"messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == "Done."
    finally:
        assert gateway.stop() == 0, gateway.log_tail()
