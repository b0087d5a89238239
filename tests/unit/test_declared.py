"""Settings declared once: every declared field has its flag and its variable, and both give the same value."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import pytest

from trajbus.gateway.config import ENV_PREFIX as GATEWAY_ENV
from trajbus.gateway.config import GatewaySettings, add_gateway_arguments, settings_from_args
from trajbus.infra.declared import (check_values, declared_fields, default_of, env_var, flag_of, is_required,
                                    resolve, to_flags)
from trajbus.infra.inference_server import ENV_PREFIX as INFERENCE_ENV
from trajbus.infra.inference_server import InferenceServerSettings
from trajbus.pipelines.cli import build_parser
from trajbus.streams.worker.settings import ENV_PREFIX as WORKER_ENV
from trajbus.streams.worker.settings import ChannelSettings, WorkerSettings

COMPONENTS = [  # (settings class, its variables' prefix, the trajbus command whose flags set it)
    (GatewaySettings, GATEWAY_ENV, "gateway"),
    (ChannelSettings, WORKER_ENV, "worker"),
    (WorkerSettings, WORKER_ENV, "worker"),
    (InferenceServerSettings, INFERENCE_ENV, "inference-server"),
]
SAMPLES = {"vllm_addresses": "h:1", "default_channel": "val", "channels": "train,val", "channel_admission": "val.max_staleness=1",
           "multi_turn": "render", "stale_action": "tag", "engine_streaming": "when-asked", "tracing": "otlp",
           "allocator": "mimalloc"}


def sample(f: dataclasses.Field, hint) -> str:
    """A valid text for the field that differs from its default."""
    if f.name in SAMPLES:
        return SAMPLES[f.name]
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    return {int: "7", float: "7.5", str: "x", Path: "/srv/x"}[base]


def subcommand(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


@pytest.mark.parametrize("cls, prefix, command", COMPONENTS, ids=lambda c: getattr(c, "__name__", None))
def test_every_setting_has_one_flag_and_one_variable_that_agree(cls, prefix, command):
    parser = subcommand(command)
    flags = {option: action for action in parser._actions for option in action.option_strings}
    for f, declared, hint in declared_fields(cls):
        action = flags[flag_of(f)]
        assert action.dest == f.name and env_var(prefix, f.name) in action.help, f.name
        if hint is bool:
            from_flag = resolve(cls, parser.parse_args([flag_of(f)]), prefix, environ={})
            from_env = resolve(cls, parser.parse_args([]), prefix, environ={env_var(prefix, f.name): "true"})
        else:
            text = sample(f, hint)
            from_flag = resolve(cls, parser.parse_args([flag_of(f), text]), prefix, environ={})
            from_env = resolve(cls, parser.parse_args([]), prefix, environ={env_var(prefix, f.name): text})
        assert from_flag == from_env and f.name in from_flag, f.name
        assert from_flag[f.name] != default_of(f), f"{f.name}: the sample must change the setting"


@pytest.mark.parametrize("cls, prefix, command", COMPONENTS, ids=lambda c: getattr(c, "__name__", None))
def test_no_flag_and_no_variable_leave_the_class_defaults(cls, prefix, command):
    assert resolve(cls, subcommand(command).parse_args([]), prefix, environ={}) == {}
    for f, _, _ in declared_fields(cls):
        if not is_required(f):
            assert check_values((cls,), {f.name: default_of(f)}, "x") == {f.name: default_of(f)}, f.name


def test_a_flag_wins_over_its_variable_and_a_bad_variable_is_named(monkeypatch):
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    monkeypatch.setenv("TRAJBUS_GATEWAY_PROMPT_LENGTH", "300")
    monkeypatch.setenv("TRAJBUS_GATEWAY_VLLM_ADDRESSES", "a:1,b:2")
    monkeypatch.setenv("TRAJBUS_GATEWAY_TOKENIZER_PATH", "tok")
    settings = settings_from_args(parser.parse_args(["--prompt-length", "200"]))
    assert (settings.prompt_length, settings.vllm_addresses) == (200, ["http://a:1", "http://b:2"])
    assert settings_from_args(parser.parse_args([])).prompt_length == 300
    monkeypatch.setenv("TRAJBUS_GATEWAY_PROMPT_LENGTH", "-3")
    with pytest.raises(ValueError, match=r"\$TRAJBUS_GATEWAY_PROMPT_LENGTH: expected a positive integer"):
        settings_from_args(parser.parse_args([]))
    monkeypatch.delenv("TRAJBUS_GATEWAY_PROMPT_LENGTH")
    monkeypatch.delenv("TRAJBUS_GATEWAY_TOKENIZER_PATH")
    with pytest.raises(ValueError, match="--tokenizer-path required"):
        settings_from_args(parser.parse_args([]))


def test_to_flags_starts_a_service_with_a_configs_settings():
    flags = to_flags((ChannelSettings, WorkerSettings), {"max_queue_size": 6, "group_filter": None,
                                                         "drop_equal_rewards": True, "metrics_port": 9})
    assert flags == ["--max-queue-size", "6", "--drop-equal-rewards", "--metrics-port", "9"]
    args = subcommand("worker").parse_args(flags)
    assert resolve(ChannelSettings, args, WORKER_ENV, environ={}) == {"max_queue_size": 6,
                                                                      "drop_equal_rewards": True}
    with pytest.raises(ValueError, match="prompt_length: not a setting of ChannelSettings, WorkerSettings"):
        to_flags((ChannelSettings, WorkerSettings), {"prompt_length": 3})
