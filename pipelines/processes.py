"""Child processes of trajbus's own commands (worker, gateway, inference server, scripted engine), started and
stopped cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from trajbus.infra.local import free_port

__all__ = ["ServiceProcess", "free_port", "gateway_process", "inference_server_process", "scripted_engine_process",
           "wait_http", "worker_process"]


class ServiceProcess:
    """One ``trajbus`` subcommand (or another module's ``main``) running as a child process, its
    output in a log file."""

    def __init__(self, args: list[str], log_file: Path | str, env: dict[str, str] | None = None,
                 module: str = "trajbus.pipelines.cli") -> None:
        self.args, self.module = args, module
        self.log_file = Path(log_file)
        self.env = env
        self.process: subprocess.Popen | None = None

    def start(self, own_session: bool = False) -> "ServiceProcess":
        """``own_session``: a Ctrl-C in the terminal reaches only the parent, which then stops
        this child in order (the parent's teardown), instead of every process at once."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(self.env or {})}, start_new_session=own_session,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful: offsets committed, consumer group left), SIGKILL past the timeout."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: the crash that recovery must survive."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def worker_process(bootstrap_servers: str, prefix: str, log_file: Path | str, channels: str = "train",
                   n_rollouts: int = 4, extra: list[str] | None = None) -> ServiceProcess:
    """A ``trajbus worker`` child (not yet started)."""
    return ServiceProcess(
        ["worker", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix, "--channels", channels,
         "--n-rollouts", str(n_rollouts), *(extra or [])],
        log_file,
    )


def wait_http(url: str, timeout: float, process: ServiceProcess | None = None, status: int = 200) -> None:
    """Poll ``url`` until it answers ``status``; fail early if ``process`` died, with its log."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            raise RuntimeError(f"{process.args[0]} exited with {process.process.returncode}:\n{process.log_tail()}")
        try:
            response = httpx.get(url, timeout=2.0)
            if response.status_code == status:
                return
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.2)
    tail = process.log_tail() if process is not None else ""
    raise TimeoutError(f"{url} did not answer {status} within {timeout}s (last: {last})\n{tail}")


def inference_server_process(port: int, log_file: Path | str, model_dir: Path | str | None = None) -> ServiceProcess:
    """A ``trajbus inference-server`` child (not yet started); ready when ``/health`` answers."""
    args = ["inference-server", "--port", str(port)]
    if model_dir is not None:
        args += ["--model-dir", str(model_dir)]
    return ServiceProcess(args, log_file)


def scripted_engine_process(port: int, workdir: Path, tokenizer_path: Path | str, replies: list[str | dict],
                            record: Path | None = None, workers: int = 1) -> ServiceProcess:
    """An ``infra.scripted_engine`` child (not yet started) serving ``replies`` (written to ``workdir``,
    which also holds its log), ``workers`` generations at once; ready when ``/health`` answers."""
    script = workdir / f"replies-{port}.json"
    script.write_text(json.dumps(replies))
    args = ["--tokenizer-path", str(tokenizer_path), "--replies", str(script), "--port", str(port),
            "--workers", str(workers)]
    if record is not None:
        args += ["--record", str(record)]
    return ServiceProcess(args, workdir / f"engine-{port}.log", module="trajbus.infra.scripted_engine")


def gateway_process(bootstrap_servers: str, prefix: str, backends: list[str], tokenizer_path: Path | str,
                    port: int, state_dir: Path | str, log_file: Path | str,
                    extra: list[str] | None = None) -> ServiceProcess:
    """A ``trajbus gateway`` child (not yet started); ready when ``/ready`` answers 200. No load balancer
    stands before a local child, so it stops listening at once on SIGTERM (``--drain-delay 0``, which
    ``extra`` may override)."""
    return ServiceProcess(
        ["gateway", "--bootstrap-servers", bootstrap_servers, "--prefix", prefix,
         "--vllm-addresses", ",".join(backends), "--tokenizer-path", str(tokenizer_path), "--port", str(port),
         "--state-dir", str(state_dir), "--drain-delay", "0", *(extra or [])],
        log_file,
    )
