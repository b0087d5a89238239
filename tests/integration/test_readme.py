"""README.md's examples run as written, in the order a reader meets them, against the session's broker.

pytest-codeblocks reads the blocks and their markers (``<!-- pytest.mark.skip(reason=...) -->``
before a block, ``<!-- pytest-codeblocks:expected-output -->`` before the output shown under
it); each block runs as a reader would run it: a shell block in bash, a Python block as a script,
from the repository's root, with ``TRAJBUS_BOOTSTRAP_SERVERS`` naming the session's broker (and
the gateway's state in a folder of the test's). What a shell block leaves running (``trajbus
worker &``, the inference server and the gateway) serves the blocks after it and is stopped at
the end. The README's blocks use the default topic prefix, which no other test uses. Whatever a
block prints, stdout and stderr, holds no library line below WARNING: only trajbus speaks.
tests/unit/test_readme_claims.py parses the command lines of the blocks skipped here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import pytest
from pytest_codeblocks import CodeBlock, extract_from_file

from trajbus.infra.bootstrap import ENV_VAR
from trajbus.infra.group_lag import consumer_group_lag
from trajbus.streams.wire.topics import groups_topic, trainer_group_id

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCKS = [block for block in extract_from_file(README) if block.syntax in ("python", "bash", "sh")]
BLOCK_TIMEOUT = 120

OUR_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (?P<level>[A-Z]+) (?P<name>\S+) ")
LIBRARY_LINE = re.compile(r"rdkafka#|^%\d\||aiokafka|^(INFO|DEBUG):")


def library_chatter(text: str) -> list[str]:
    """Lines a library wrote below WARNING: in our format from a logger not under ``trajbus``, or
    in a library's own format (librdkafka's stderr, Python's last-resort handler, uvicorn's)."""
    chatter = []
    for line in text.splitlines():
        ours = OUR_LINE.match(line)
        if ours:
            if ours["level"] in ("DEBUG", "INFO") and not ours["name"].startswith("trajbus"):
                chatter.append(line)
        elif LIBRARY_LINE.search(line):
            chatter.append(line)
    return chatter


def test_chatter_is_told_from_our_lines():
    assert library_chatter("2026-11-24 04:04:02,538 INFO trajbus.worker group emitted\nprovisioned 9 topics\n"
                           "2026-11-24 04:04:08,146 WARNING mode.timers Timer overlapping") == []
    assert len(library_chatter("GETPID [rdkafka#producer-1] [thrd:main]: Coordinator load in progress\n"
                               "%4|1732420000.123|GETPID|rdkafka#producer-1| retrying\n"
                               "2026-11-24 04:04:02,538 INFO aiokafka.consumer.group_coordinator joined")) == 3


class Reader:
    """A reader's terminal: the environment every block runs in, and what blocks leave running."""

    def __init__(self, bootstrap_servers: str, out: Path) -> None:
        self.env = {**os.environ, ENV_VAR: bootstrap_servers, "PYTHONUNBUFFERED": "1",
                    "TRAJBUS_GATEWAY_STATE_DIR": str(out / "gateway-state")}
        self.out = out
        self.sessions: list[subprocess.Popen] = []
        self.outputs: list[Path] = []

    def run(self, block: CodeBlock) -> tuple[str, str]:
        """(stdout, stderr) of one block; files, not pipes, so a background job cannot hold them open."""
        name = f"line{block.lineno}"
        stdout, stderr = self.out / f"{name}.out", self.out / f"{name}.err"
        self.outputs += [stdout, stderr]
        if block.syntax == "python":
            script = self.out / f"{name}.py"
            script.write_text(block.code)
            command = [sys.executable, str(script)]
        else:
            command = ["bash", "-e", "-c", block.code]
        with stdout.open("w") as out, stderr.open("w") as err:
            process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=out, stderr=err,
                                       start_new_session=True)
            self.sessions.append(process)
            try:
                returncode = process.wait(BLOCK_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                raise
        assert returncode == 0, f"README line {block.lineno} exited {returncode}:\n{stderr.read_text()[-3000:]}"
        return stdout.read_text(), stderr.read_text()

    def close(self) -> None:
        """SIGINT to what each block left running (the worker stops gracefully), SIGKILL past a deadline."""
        for session in self.sessions:
            left = [p for p in psutil.process_iter() if _in_session(p, session.pid)]
            for process in left:
                process.send_signal(signal.SIGINT)
            _, alive = psutil.wait_procs(left, timeout=30)
            for process in alive:
                process.kill()
            session.poll()


def _in_session(process: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(process.pid) == sid and process.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        return False


@pytest.fixture(scope="module")
def reader(bootstrap_servers: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Reader]:
    """The reader's terminal; the tiny model is built first (cached), as the gateway's block needs it."""
    if os.environ.get(ENV_VAR):
        pytest.skip("the README's blocks use the default prefix: they run on the session's own fresh broker")
    reader = Reader(bootstrap_servers, tmp_path_factory.mktemp("readme"))
    yield reader
    reader.close()
    chatter = [f"{path.name}: {line}" for path in reader.outputs for line in library_chatter(path.read_text())]
    assert not chatter, "library lines below WARNING reached the terminal:\n" + "\n".join(chatter)


@pytest.mark.parametrize("block", [
    pytest.param(block, id=f"line {block.lineno}",
                 marks=[eval(mark, {"pytest": pytest}) for mark in block.marks])  # the README's own markers
    for block in BLOCKS])
def test_readme_block(block: CodeBlock, reader: Reader):
    stdout, stderr = reader.run(block)
    assert not library_chatter(stdout + stderr), stderr
    if block.expected_output is not None:
        assert stdout == block.expected_output, f"README line {block.lineno} printed:\n{stdout}"


def test_the_examples_leave_no_group_uncommitted(reader: Reader, bootstrap_servers: str):
    """Each example that fetches a group commits it, as the README says a trainer must: the trainer's
    consumer group is at the end of the train channel's groups (else a new consumer gets them again)."""
    lags = consumer_group_lag(bootstrap_servers, trainer_group_id("train"), groups_topic("train"))
    assert [(lag.high, lag.lag) for lag in lags] == [(2, 0)], lags  # p0 and add-3-4, both committed


def test_the_gateway_refuses_what_the_readme_says(reader: Reader):
    """README, "The gateway", of the gateway its block started (port 8100, --api-key change-me): an
    init_trajectory without prompt_uid is 400 missing_prompt_uid; a channel without topics is a 400
    that names the channels there are."""
    init, key = "http://127.0.0.1:8100/init_trajectory", {"Authorization": "Bearer change-me"}
    missing = httpx.post(init, headers=key, json={"n_rollouts": 2}, timeout=30)
    assert (missing.status_code, missing.json()["error"]["code"]) == (400, "missing_prompt_uid"), missing.text
    unknown = httpx.post(init, headers=key, json={"prompt_uid": "p1", "channel": "trian"}, timeout=30)
    known = unknown.json()["error"]["message"].partition("known channels: ")[2]
    assert unknown.status_code == 400 and {"train", "val"} <= set(re.findall(r"\w+", known)), unknown.text


@pytest.mark.parametrize("how", ["script", "-c"])
def test_a_script_beside_the_checkout_imports_the_package(how: str, tmp_path: Path):
    """A folder holding a clone named ``trajbus/`` (the checkout's root: no ``__init__.py``) is no package,
    yet Python would import it as an empty namespace package ("unknown location"); the venv's
    ``trajbus-first.pth`` (Makefile) imports trajbus before the script's folder is on the path."""
    (tmp_path / "trajbus").mkdir()
    (tmp_path / "trajbus" / "pyproject.toml").write_text("# a checkout's root, not the package\n")
    code = "from trajbus import BatchConsumer\nprint(BatchConsumer.__module__)\n"
    (tmp_path / "train.py").write_text(code)
    command = [sys.executable, "train.py"] if how == "script" else [sys.executable, "-c", code]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"(`make install` writes trajbus-first.pth)\n{result.stderr}"
    assert result.stdout == "trajbus.consumers.batch_consumer\n"
