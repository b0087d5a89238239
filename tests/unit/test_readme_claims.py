"""What README.md and the docs site say that the code can check without a broker: every block that
tests/integration/test_docs.py does not run is at least parsed here, and the pages' words about
discovery and provisioning are the code's.

- Every ``trajbus`` command line of every shell block parses with the CLI's own
  parser (``pipelines.cli.build_parser``), so a wrong flag or a usage bracket
  (``[--json]``) fails; every ``make`` line names a Makefile target.
- Every Python block compiles, and the imports of those the integration test skips run.
- The discovery paragraph is ``infra.bootstrap.DISCOVERY``, which the error of a
  failed search quotes; the ``topics --create`` paragraph names every topic it makes.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from pytest_codeblocks import CodeBlock, extract_from_file

from tests.docs_pages import README, ROOT, SESSIONS, name

from trajbus.gateway.rewards import answer_match
from trajbus.infra import bootstrap
from trajbus.pipelines.cli import build_parser
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.topics import DEFAULT_CHANNELS

PAGES = [page for pages in SESSIONS.values() for page in pages]
BLOCKS = [(page, block) for page in PAGES for block in extract_from_file(page)]
SHELL_BLOCKS = [(page, block) for page, block in BLOCKS if block.syntax in ("bash", "sh")]
PYTHON_BLOCKS = [(page, block) for page, block in BLOCKS if block.syntax == "python"]
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
LAYOUT = ROOT / "docs" / "layout.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = {";", "&", "&&", "|", "||"}


def words(text: str) -> str:
    """Markdown prose with its line breaks as single spaces."""
    return " ".join(text.split())


def command_lines(code: str) -> list[list[str]]:
    """The simple commands of a shell block as argv lists: continuations joined, comments dropped,
    split at ``;``, ``&``, ``&&`` and ``|``, leading ``NAME=value`` assignments left out."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token in OPERATORS:
                while command and ASSIGNMENT.match(command[0]):
                    command.pop(0)
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(token)
    return commands


def test_command_lines_are_split_as_a_shell_splits_them():
    assert command_lines('A=1 .venv/bin/trajbus worker &   # runs on\n'
                         '.venv/bin/trajbus gateway --x "$K" \\\n    --y 2 && make test  # done') == [
        [".venv/bin/trajbus", "worker"], [".venv/bin/trajbus", "gateway", "--x", "$K", "--y", "2"], ["make", "test"]]


def parse_error(argv: list[str]) -> str | None:
    """What the CLI's parser says of ``argv`` (None: it parses)."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            build_parser().parse_args(argv)
    except SystemExit:
        return said.getvalue().strip().splitlines()[-1]
    return None


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


@pytest.mark.parametrize("page, block", SHELL_BLOCKS, ids=[f"{name(p)} line {b.lineno}" for p, b in SHELL_BLOCKS])
def test_every_command_line_parses(page: Path, block: CodeBlock):
    for argv in command_lines(block.code):
        program = Path(argv[0]).name
        brackets = [word for word in argv if word.startswith("[") or word.endswith("]")]
        assert not brackets, f"{name(page)} line {block.lineno}: usage brackets in a command: {' '.join(argv)}"
        if program == "trajbus":
            assert parse_error(argv[1:]) is None, \
                f"{name(page)} line {block.lineno}: `{' '.join(argv)}`: {parse_error(argv[1:])}"
        elif program == "make":
            assert set(argv[1:]) <= makefile_targets(), f"{name(page)} line {block.lineno}: no such make target: {argv}"


def test_a_wrong_flag_is_caught():
    assert "unrecognized arguments: [--from-beginning] [--json]" in \
        parse_error(["tail", "trajbus.steps.train", "[--from-beginning]", "[--json]"])


@pytest.mark.parametrize("page, block", PYTHON_BLOCKS, ids=[f"{name(p)} line {b.lineno}" for p, b in PYTHON_BLOCKS])
def test_every_python_block_compiles_and_imports(page: Path, block: CodeBlock):
    tree = ast.parse(block.code, filename=f"{name(page)}:{block.lineno}")
    if block.marks:  # not run by the integration test: its imports at least
        imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        exec(compile(ast.Module(body=imports, type_ignores=[]), f"{name(page)}:{block.lineno}", "exec"), {})


def test_the_discovery_paragraph_is_the_one_the_error_quotes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    assert f"Every component finds the broker the same way: {words(bootstrap.DISCOVERY)}." in words(GETTING_STARTED.read_text())
    for way in ("--bootstrap-servers", bootstrap.ENV_VAR, "trajbus broker up", "TRAJBUS_STATE_DIR", "--state-dir"):
        assert way in bootstrap.DISCOVERY
    monkeypatch.setenv("TRAJBUS_STATE_DIR", str(tmp_path / "no-broker"))
    monkeypatch.delenv(bootstrap.ENV_VAR, raising=False)
    with pytest.raises(bootstrap.BrokerNotFound) as error:
        bootstrap.resolve_bootstrap_servers()
    message = str(error.value)
    assert bootstrap.DISCOVERY in message and str(tmp_path / "no-broker") in message and "\n" not in message


def test_topics_create_is_described_as_it_provisions():
    specs = TopicSettings().specs(DEFAULT_CHANNELS)
    kinds = {spec.name.split(".")[1] for spec in specs}  # trajbus.steps.train -> steps, trajbus.dlq -> dlq
    paragraph = words(GETTING_STARTED.read_text()).split("`topics --create` provisions ", 1)[1].split(" topics.", 1)[0]
    assert f"default `{','.join(DEFAULT_CHANNELS)}`" in paragraph
    assert [kind for kind in sorted(kinds) if kind not in paragraph] == []
    assert paragraph.endswith(f": {len(specs)}"), paragraph


def test_a_checkout_beside_a_script_is_explained():
    text = words(LAYOUT.read_text())
    assert "unknown location" in text and "trajbus-first.pth" in text


@pytest.mark.parametrize("answer, reply, reward", [
    ("7", "3 + 4 = 7.", 1.0), ("7", "3 + 4 = 8.", 0.0), ("7", "seven", 0.0), ("1000", "It is 1,000.0", 1.0),
    ("-3", "x = -3", 1.0), ("Paris", "  paris ", 1.0), ("Paris", "Lyon", 0.0), ("nan", "nan", 1.0)])
def test_answer_match_scores_the_final_answer(answer: str, reply: str, reward: float):
    """The reward function the README's gateway runs with: the reply's last number, else the whole reply."""
    assert answer_match({"metadata": {"answer": answer}, "response_text": reply}) == reward


def test_answer_match_without_an_answer_says_where_it_goes():
    with pytest.raises(ValueError, match="give it at init_trajectory"):
        answer_match({"metadata": {}, "response_text": "7"})


def test_the_readmes_links_lead_to_files():
    """The site's links are checked by its strict build; the README's, read on a code host, here."""
    targets = [target for target in LINK.findall(README.read_text()) if "://" not in target]
    assert targets and [target for target in targets if not (ROOT / target).exists()] == []


def test_the_readme_stays_a_first_screen():
    assert len(README.read_text().splitlines()) <= 200
