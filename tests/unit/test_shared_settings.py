"""A setting that several components have is declared once (infra.shared_settings, GatewaySettings.prefix):
every command's flag for it has the same default, parsing and words."""

from __future__ import annotations

import inspect

import pytest

from trajbus.consumers.batch_consumer import BatchConsumer
from trajbus.infra.outage import OUTAGE_LIMIT
from tests.unit.test_declared import subcommand


def flag(command: str, name: str):
    return next(a for a in subcommand(command)._actions if name in a.option_strings)


def words(action) -> str:
    """A flag's help without what follows its default (a component's variable)."""
    return action.help.split(";")[0].rstrip(")")


def test_every_command_s_prefix_is_the_one_declaration():
    commands = ["topics", "worker", "stats", "replay", "gateway"]
    helps = {command: words(flag(command, "--prefix")) for command in commands}
    assert set(helps.values()) == {"topic name prefix (default: trajbus"}, helps
    for command, required in [("topics", []), ("worker", []), ("stats", []), ("replay", ["--channel", "train"])]:
        assert subcommand(command).parse_args(required).prefix == "trajbus"  # read as args.prefix
        assert subcommand(command).parse_args([*required, "--prefix", "p1"]).prefix == "p1"


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_the_outage_limit_has_one_default_and_one_rule(command, capsys):
    action = flag(command, "--broker-outage-limit")
    assert f"(default: {OUTAGE_LIMIT}" in action.help and "exits non-zero for a supervisor" in action.help
    with pytest.raises(SystemExit):
        subcommand(command).parse_args(["--broker-outage-limit", "0"])
    assert "expected a positive number, got 0.0" in capsys.readouterr().err
    assert inspect.signature(BatchConsumer).parameters["outage_limit"].default == OUTAGE_LIMIT
