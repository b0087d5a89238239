"""The examples of README.md and of every page of the docs site run as written, in the order a reader meets
them, against the session's broker; the site builds strictly.

pytest-codeblocks reads the blocks and their markers (``<!-- pytest.mark.skip(reason=...) -->``
before a block, ``<!-- pytest-codeblocks:expected-output -->`` before the output shown under
it). Each session (the README alone; the site's pages in the order of its navigation,
tests/docs_pages.py) is one reader in one shell: a shell block is sourced into that bash, so what
it exports or starts in the background (``trajbus worker &``) is there for the blocks after it,
and ``kill -INT $(jobs -p)`` stops them; a Python block runs as a script, twice (an example must
run again as written), from the repository's root, with ``TRAJBUS_BOOTSTRAP_SERVERS`` naming the
session's broker (and the gateway's state in a folder of the test's). The blocks use the default
topic prefix, which no other test uses. Whatever a block prints, stdout and stderr, holds no
library line below WARNING: only trajbus speaks. tests/unit/test_readme_claims.py parses the
command lines of the blocks skipped here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from pytest_codeblocks import CodeBlock

from tests.docs_pages import MKDOCS, ROOT, SESSIONS, name, runnable_blocks
from trajbus.infra.bootstrap import ENV_VAR
from trajbus.infra.group_lag import consumer_group_lag
from trajbus.streams.wire.topics import groups_topic, trainer_group_id

BLOCK_TIMEOUT = 120
BLOCKS = [(session, page, block) for session, pages in SESSIONS.items() for page in pages
          for block in runnable_blocks(page)]

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
    """A reader's terminal: one bash for a session's blocks, and the files each block printed to."""

    def __init__(self, bootstrap_servers: str, out: Path) -> None:
        env = {**os.environ, ENV_VAR: bootstrap_servers, "PYTHONUNBUFFERED": "1",
               "TRAJBUS_GATEWAY_STATE_DIR": str(out / "gateway-state")}
        self.out = out
        self.outputs: list[Path] = []
        # -e: a failing command fails its block (the shell exits); -m: jobs as in a terminal (SIGINT reaches them)
        self.shell = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE, cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                                      start_new_session=True)
        self._send("set -e -m")

    def _send(self, line: str) -> None:
        assert self.shell.poll() is None, f"the reader's shell ended ({self.shell.returncode}) at an earlier block"
        self.shell.stdin.write(line + "\n")
        self.shell.stdin.flush()

    def run(self, block: CodeBlock, label: str) -> tuple[str, str]:
        """(stdout, stderr) of one block, sourced into the shell; files, not pipes, so a background job
        cannot hold them open."""
        stem = self.out / re.sub(r"\W+", "-", label)
        stdout, stderr, status = (stem.with_suffix(suffix) for suffix in (".out", ".err", ".status"))
        self.outputs += [stdout, stderr]
        script = stem.with_suffix(".sh")
        if block.syntax == "python":
            stem.with_suffix(".py").write_text(block.code)
            script.write_text(f"{shlex.quote(sys.executable)} {shlex.quote(str(stem.with_suffix('.py')))}\n")
        else:
            script.write_text(block.code)
        status.unlink(missing_ok=True)
        self._send(f"source {shlex.quote(str(script))} > {shlex.quote(str(stdout))} 2> {shlex.quote(str(stderr))}; "
                   f"echo $? > {shlex.quote(str(status))}.part; mv {shlex.quote(str(status))}.part "
                   f"{shlex.quote(str(status))}")
        deadline = time.monotonic() + BLOCK_TIMEOUT
        while not status.exists() and self.shell.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        said = stderr.read_text()[-3000:] if stderr.exists() else ""
        assert status.exists(), (f"{label} did not end within {BLOCK_TIMEOUT} s" if self.shell.poll() is None
                                 else f"{label} failed: the shell exited {self.shell.returncode}") + f":\n{said}"
        assert status.read_text().strip() == "0", f"{label} exited {status.read_text().strip()}:\n{said}"
        return stdout.read_text(), stderr.read_text()

    def close(self) -> None:
        """SIGINT to what the session left running (the worker stops gracefully), SIGKILL past a deadline."""
        if self.shell.poll() is None:
            self.shell.stdin.close()
        left = [p for p in psutil.process_iter() if _in_session(p, self.shell.pid) and p.pid != self.shell.pid]
        for process in left:
            process.send_signal(signal.SIGINT)
        _, alive = psutil.wait_procs(left, timeout=30)
        for process in alive:
            process.kill()
        try:
            self.shell.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.shell.pid, signal.SIGKILL)
            self.shell.wait()


def _in_session(process: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(process.pid) == sid and process.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        return False


class Readers:
    """One reader per session, in order: a session's reader is closed before the next one starts."""

    def __init__(self, bootstrap_servers: str, out: Path) -> None:
        self.bootstrap_servers, self.out = bootstrap_servers, out
        self.current: tuple[str, Reader] | None = None
        self.outputs: list[Path] = []

    def of(self, session: str) -> Reader:
        if self.current is None or self.current[0] != session:
            self.close()
            folder = self.out / session
            folder.mkdir()
            self.current = (session, Reader(self.bootstrap_servers, folder))
        return self.current[1]

    def close(self) -> None:
        if self.current is not None:
            self.current[1].close()
            self.outputs += self.current[1].outputs
            self.current = None


@pytest.fixture(scope="module")
def readers(bootstrap_servers: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Readers]:
    """The readers' terminals; the tiny model is built first (cached), as the gateway's block needs it."""
    if os.environ.get(ENV_VAR):
        pytest.skip("the docs' blocks use the default prefix: they run on the session's own fresh broker")
    readers = Readers(bootstrap_servers, tmp_path_factory.mktemp("docs"))
    yield readers
    readers.close()
    chatter = [f"{path.parent.name}/{path.name}: {line}" for path in readers.outputs
               for line in library_chatter(path.read_text())]
    assert not chatter, "library lines below WARNING reached the terminal:\n" + "\n".join(chatter)


@pytest.mark.parametrize("session, page, block", [
    pytest.param(session, page, block, id=f"{name(page)} line {block.lineno}",
                 marks=[eval(mark, {"pytest": pytest}) for mark in block.marks])  # the page's own markers
    for session, page, block in BLOCKS])
def test_docs_block(session: str, page: Path, block: CodeBlock, readers: Readers):
    reader = readers.of(session)
    label = f"{name(page)} line {block.lineno}"
    for run in (1, 2) if block.syntax == "python" else (1,):
        stdout, stderr = reader.run(block, f"{label} run {run}")
        assert not library_chatter(stdout + stderr), stderr
        if block.expected_output is not None:
            assert stdout == block.expected_output, f"{label} (run {run}) printed:\n{stdout}"


def test_the_examples_leave_no_group_uncommitted(readers: Readers, bootstrap_servers: str):
    """Each example that fetches a group commits it, as a trainer must: the trainer's consumer group is at
    the end of the train channel's groups (else a new consumer would get them again)."""
    lags = consumer_group_lag(bootstrap_servers, trainer_group_id("train"), groups_topic("train"))
    assert lags and all(lag.high > 0 and lag.lag == 0 for lag in lags), lags


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("mkdocs")), "build", "--strict", "--config-file",
                           str(config), "--site-dir", str(site)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strictly(tmp_path: Path):
    built = mkdocs_build(MKDOCS, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "getting-started" / "index.html").exists()


@pytest.mark.parametrize("mistake, said", [
    ("a broken link", "contains a link 'no-such-page.md'"),
    ("a page out of the navigation", "orphan.md"),
])
def test_a_strict_build_fails_on(mistake: str, said: str, tmp_path: Path):
    """What the strict build is for: a copy of the site with one mistake does not build."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(MKDOCS, tmp_path / "mkdocs.yml")
    if mistake == "a broken link":
        with (tmp_path / "docs" / "concepts.md").open("a") as page:
            page.write("\nSee [nothing](no-such-page.md).\n")
    else:
        (tmp_path / "docs" / "orphan.md").write_text("# Not in the navigation\n")
    built = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0 and said in built.stderr, built.stderr


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
