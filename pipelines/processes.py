"""Child processes of trajbus's own commands (worker, later gateway), started and stopped cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


class ServiceProcess:
    """One ``trajbus`` subcommand running as a child process, its output in a log file."""

    def __init__(self, args: list[str], log_file: Path | str, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_file = Path(log_file)
        self.env = env
        self.process: subprocess.Popen | None = None

    def start(self) -> "ServiceProcess":
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pipelines.cli", *self.args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(self.env or {})},
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
