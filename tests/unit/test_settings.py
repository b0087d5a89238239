"""Settings validation: channel rules, worker settings, dotted imports, and the gateway's flags."""

from __future__ import annotations

import argparse
import hashlib
import os.path

import pytest

from trajbus.gateway.config import GatewaySettings, _addresses, add_gateway_arguments, settings_from_args
from trajbus.infra.arguments import positive_int
from trajbus.infra.dotted import import_dotted
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.worker.settings import ChannelSettings, WorkerSettings


@pytest.mark.parametrize("field, value", [
    ("n_rollouts", 0), ("n_rollouts", True), ("n_rollouts", 2.0),
    ("min_rollouts", 0), ("max_queue_size", 0),
    ("max_staleness", -1), ("max_staleness", 1.5),
    ("stale_action", "skip"),
    ("group_timeout", 0), ("group_timeout", -1.0), ("group_timeout", "5"), ("group_timeout", True),
    ("group_filter", "no_such_module_xyz.f"),
])
def test_invalid_channel_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        ChannelSettings(**{field: value})


def test_valid_channel_settings_are_accepted():
    s = ChannelSettings(n_rollouts=8, max_staleness=0, stale_action="tag", group_timeout=0.5,
                        max_queue_size=1, group_filter="tests.group_filters:drop_marked")
    assert s.max_staleness == 0 and s.group_timeout == 0.5
    assert s.load_group_filter().__name__ == "drop_marked"
    assert ChannelSettings().load_group_filter() is None


def test_replace_validates_and_refuses_unknown_keys():
    s = ChannelSettings()
    assert s.replace(n_rollouts=2).n_rollouts == 2
    assert s.n_rollouts == 4  # frozen: the original is unchanged
    with pytest.raises(ValueError, match="^n_rolouts: not a channel setting"):
        s.replace(n_rolouts=2)
    with pytest.raises(ValueError, match="^n_rollouts: "):
        s.replace(n_rollouts=0)


def test_import_dotted_accepts_colon_and_dot_forms():
    assert import_dotted("os.path:join", "reward_function") is os.path.join
    assert import_dotted("os.path.join", "reward_function") is os.path.join


@pytest.mark.parametrize("path, match", [
    ("join", "not a dotted path"),
    ("os.path:", "not a dotted path"),
    ("no_such_module_xyz.f", "cannot import"),
    ("os.path.no_such_function", "cannot import"),
])
def test_import_dotted_errors_name_what(path, match):
    with pytest.raises(ValueError, match=f"^reward_function: .*{match}"):
        import_dotted(path, what="reward_function")


def test_group_filter_must_be_callable():
    with pytest.raises(ValueError, match="^group_filter: 'math.pi' is not callable"):
        ChannelSettings(group_filter="math.pi")


def test_worker_settings_refuse_overrides_for_an_unserved_channel():
    with pytest.raises(ValueError, match="^channel: settings given for 'val'"):
        WorkerSettings(channels=("train",), overrides={"val": ChannelSettings()})
    with pytest.raises(ValueError, match="^channel: "):
        WorkerSettings(channels=("Train!",))
    with pytest.raises(ValueError, match="^channels: at least one"):
        WorkerSettings(channels=())


def test_channel_returns_the_override_else_the_default():
    special = ChannelSettings(n_rollouts=2)
    s = WorkerSettings(channels=("train", "val"), default=ChannelSettings(n_rollouts=8),
                       overrides={"val": special})
    assert s.channel("val") is special
    assert s.channel("train").n_rollouts == 8


def test_app_id_names_the_sorted_channel_set():
    a = WorkerSettings(channels=("val", "train"), topics=TopicSettings(prefix="exp1"))
    b = WorkerSettings(channels=("train", "val"), topics=TopicSettings(prefix="exp1"))
    assert a.app_id == b.app_id == "exp1-worker-train.val"
    assert WorkerSettings(channels=("train",)).app_id == "trajbus-worker-train"
    assert WorkerSettings(channels=("train", "train")).app_id == "trajbus-worker-train", "one channel set, one group"
    with pytest.raises(ValueError, match="^channels: a sequence"):
        WorkerSettings(channels="train")


def test_app_id_hashes_a_long_channel_set():
    channels = tuple(f"channel-{i:02d}" for i in range(12))  # 12 * 10 + 11 dots > 100 characters
    joined = ".".join(sorted(channels))
    app_id = WorkerSettings(channels=channels).app_id
    assert app_id == "trajbus-worker-" + hashlib.sha1(joined.encode()).hexdigest()[:12]


@pytest.mark.parametrize("text, value", [("1", 1), ("42", 42)])
def test_positive_int_accepts_positive_integers(text, value):
    assert positive_int(text) == value


@pytest.mark.parametrize("text", ["0", "-3", "1.5", "ten", ""])
def test_positive_int_refuses_the_rest(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive integer"):
        positive_int(text)


def test_addresses_are_normalised():
    assert _addresses(" a:1, https://b:2/ ,") == ["http://a:1", "https://b:2"]
    with pytest.raises(argparse.ArgumentTypeError):
        _addresses(" , ")


def parser():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_gateway_arguments(p)
    return p


def test_gateway_flags_become_settings(tmp_path):
    args = parser().parse_args(["--vllm-addresses", "h:1,h:2", "--tokenizer-path", "tok",
                                "--prompt-length", "100", "--channel", "val", "--state-dir", str(tmp_path),
                                "--public-url", "https://gw.example/", "--channels", "train, val,train"])
    settings = settings_from_args(args)
    assert isinstance(settings, GatewaySettings)
    assert settings.vllm_addresses == ["http://h:1", "http://h:2"]
    assert (settings.prompt_length, settings.default_channel, settings.state_dir) == (100, "val", tmp_path)
    assert settings.base_address == "https://gw.example" and settings.channels == ("train", "val")
    assert GatewaySettings(["x"], "tok", host="0.0.0.0", port=9).base_address == "http://0.0.0.0:9"


@pytest.mark.parametrize("flag, value", [("--prompt-length", "0"), ("--max-body-bytes", "-1"),
                                         ("--channel", "Bad Channel"), ("--channels", "train,Bad"),
                                         ("--channels", ",")])
def test_gateway_flags_refuse_invalid_values(flag, value):
    with pytest.raises(argparse.ArgumentError, match=flag):
        parser().parse_args(["--vllm-addresses", "h:1", "--tokenizer-path", "tok", flag, value])
