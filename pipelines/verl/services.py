"""The gateway and stream worker the V1 manager runs when the user names no gateway of their own.

The gateway talks to verl's own inference servers, so verl keeps syncing weights into them: their
addresses are what verl's load balancer (behind the ``llm_client`` verl hands the manager) routes to.
The worker assembles both channels' groups. Both are child processes of the manager's process, their
logs in ``{default_local_dir}/trajbus``, stopped when the manager closes or its process exits.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
from pathlib import Path
from typing import Any

from trajbus.pipelines.processes import ServiceProcess, free_port, gateway_process, wait_http, worker_process

__all__ = ["OwnServices", "engine_addresses"]

log = logging.getLogger("trajbus.verl")

READY_TIMEOUT = 180.0
"""Seconds the gateway may take to load its tokenizer and reach an engine."""


def engine_addresses(llm_client: Any) -> list[str]:
    """``host:port`` of each inference server behind verl's ``LLMServerClient`` (its load balancer's
    registry, keyed by the servers' OpenAI-compatible addresses)."""
    import ray

    balancer = getattr(llm_client, "_load_balancer", None)
    if balancer is None:
        raise ValueError("llm_client: verl handed the manager no load balancer to find its inference servers "
                         "by; set TRAJBUS_VERL_GATEWAY_URL to a gateway of your own")
    servers = list(ray.get(balancer.get_status.remote())["servers"])
    if not servers:
        raise ValueError("llm_client: verl's load balancer lists no inference server")
    return [server.removeprefix("http://") for server in servers]


class OwnServices:
    """A gateway at verl's servers and a worker for ``channels`` (module docstring)."""

    def __init__(self, bootstrap_servers: str, prefix: str, channels: list[str], config: Any,
                 addresses: list[str]) -> None:
        data, rollout = config.data, config.actor_rollout_ref.rollout
        logs = Path(os.path.abspath(config.trainer.get("default_local_dir") or "checkpoints")) / "trajbus"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        prompt, response = int(data.max_prompt_length), int(data.max_response_length)
        self.processes: list[ServiceProcess] = [
            worker_process(bootstrap_servers, prefix, logs / "worker.log", ",".join(channels), int(rollout.n)),
            gateway_process(bootstrap_servers, prefix, addresses, config.actor_rollout_ref.model.path, port,
                            logs / "gateway-state", logs / "gateway.log",
                            ["--prompt-length", str(prompt + response), "--response-length", str(response)]),
        ]
        atexit.register(self.close)

    def start(self) -> str:
        """Start both and wait until the gateway is ready; its URL."""
        for process in self.processes:
            process.start()
        try:
            wait_http(f"{self.url}/ready", READY_TIMEOUT, self.processes[-1])
        except BaseException:
            self.close()
            raise
        log.info("verl V1 on trajbus: gateway %s at %s, worker for its channels", self.url,
                 self.processes[-1].args[self.processes[-1].args.index("--vllm-addresses") + 1])
        return self.url

    def close(self) -> None:
        for process in self.processes:  # both stop at once, then each is waited for
            if process.process is not None and process.alive():
                process.process.send_signal(signal.SIGTERM)
        for process in self.processes:
            if process.process is not None:
                process.stop()
