"""``trajbus ready URL`` waits for a server's ``/ready``, saying why it is not ready yet, over real HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

REASON = "no backend answers its health check: 127.0.0.1:8000"


class Readiness(BaseHTTPRequestHandler):
    """503 with a reason in the gateway's shape for the server's first ``not_ready`` calls, then 200."""

    def do_GET(self) -> None:
        assert self.path == "/ready"
        server = self.server
        server.calls += 1
        ready = server.calls > server.not_ready
        body = json.dumps({"ready": True} if ready else {"ready": False, "reason": REASON}).encode()
        self.send_response(200 if ready else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Readiness)
    server.calls, server.not_ready = 0, 2
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


def ready(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trajbus.pipelines.cli", "ready", *argv], capture_output=True,
                          text=True, timeout=60)


def test_it_says_the_reason_once_and_exits_0_when_ready(server: ThreadingHTTPServer):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    result = ready(url, "--timeout", "30")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{url} is ready\n"
    assert result.stderr.splitlines() == [f"waiting for {url}: 503: {REASON}"]  # said once, not per poll


def test_past_its_timeout_it_names_the_last_reason_and_exits_1(server: ThreadingHTTPServer):
    server.not_ready = 10**6
    url = f"http://127.0.0.1:{server.server_address[1]}"
    result = ready(url, "--timeout", "1.5")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == f"trajbus ready: {url} not ready after 1.5 s: 503: {REASON}"


def test_a_url_that_is_not_http_is_a_usage_error():
    result = ready("127.0.0.1:8100")
    assert result.returncode == 2
    assert result.stderr.strip() == "trajbus ready: url: expected http://HOST:PORT, got '127.0.0.1:8100'"
