"""Bad input on the command line: one clear line on stderr and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trajbus.infra.local import free_ports
from tests.helpers import trajbus

GATEWAY = ["gateway", "--vllm-addresses", "h:1"]
NO_FOLDER = "no such folder (nor a Hugging Face hub id, NAME or ORG/NAME)"


@pytest.mark.parametrize("args, says", [
    (["worker", "--channel-setting", "train.bogus=1"], "bogus: not a channel setting"),
    (["worker", "--channel-setting", "train.n_rollouts=many"], "n_rollouts: expected a positive integer, got 'many'"),
    (["worker", "--channel-setting", "val.n_rollouts=2", "--channels", "train"], "'val'"),
    (["worker", "--group-filter", "no_such_module.keep"], "group_filter: cannot import 'no_such_module.keep'"),
    (["worker", "--stale-action", "shrug"], "--stale-action: expected one of drop, tag, got 'shrug'"),
    (["worker", "--n-rollouts", "0"], "expected a positive integer"),
    (["worker", "--max-staleness", "-1"], "max_staleness: must be a non-negative integer, got -1"),
    (["topics", "--channels", "Not A Channel"], "is not a valid channel name"),
    (["gateway", "--tokenizer-path", "t"], "--vllm-addresses"),
    (["gateway", "--vllm-addresses", "h:1", "--tokenizer-path", "t", "--prompt-length", "-5"],
     "expected a positive integer"),
    (["gateway", "--vllm-addresses", "h:1", "--tokenizer-path", "t", "--channel", "No!"], "valid channel name"),
    (["gateway", "--vllm-addresses", "h:1", "--tokenizer-path", "t", "--reward-function", "no_such.module:f"],
     "reward_function: cannot import 'no_such.module:f'"),
    ([*GATEWAY, "--tokenizer-path", "/no/such/dir"], f"--tokenizer-path /no/such/dir: {NO_FOLDER}"),
    ([*GATEWAY, "--tokenizer-path", "./missing", "--instances", "2"], f"--tokenizer-path ./missing: {NO_FOLDER}"),
])
def test_bad_command_line_input_exits_2(args, says):
    result = trajbus(*args, "--bootstrap-servers", "127.0.0.1:9")
    assert result.returncode == 2, result.stderr
    assert says in result.stderr


@pytest.mark.parametrize("args, says", [
    (["--replication-factor", "2"], "replication factor 2 needs 2 brokers, the cluster has 1 available"),
    (["--replication-factor", "1", "--min-insync-replicas", "2"], "min_insync_replicas: 2 is above the replication"),
    (["--nodes", "10"], "out of range (1 to 9 nodes)"),
])
def test_a_replication_the_cluster_cannot_hold_is_refused_before_anything_is_written(
        args, says, bootstrap_servers, prefix):
    from trajbus.infra.topics import describe_topics

    command = ["broker", "up", *args] if args[0] == "--nodes" else \
        ["topics", "--create", "--prefix", prefix, "--bootstrap-servers", bootstrap_servers, *args]
    result = trajbus(*command)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert describe_topics(bootstrap_servers, prefix=f"{prefix}.") == []



def test_a_tokenizer_path_that_cannot_work_ends_the_gateway_with_one_line_naming_it(tmp_path: Path):
    """Refused before serving: a folder holding no tokenizer. Failing to load once serving (a broken
    tokenizer.json): the gateway closes what it started and exits 2, its last line naming the path and why,
    no traceback; a fleet (``--instances 2``) stops rather than forking its instances again. Each within a
    deadline (the helper's timeout)."""
    empty, broken = tmp_path / "empty", tmp_path / "broken"
    empty.mkdir()
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (broken / "tokenizer.json").write_text("not JSON")
    refused = trajbus(*GATEWAY, "--tokenizer-path", str(empty), "--bootstrap-servers", "127.0.0.1:9", timeout=60)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"trajbus gateway: --tokenizer-path {empty}: the folder holds no tokenizer (none of tokenizer_config.json, "
        "tokenizer.json, config.json)"], refused.stderr
    for instances in ("1", "2"):
        port = free_ports(3)  # the door, and each instance's own
        ended = trajbus(*GATEWAY, "--tokenizer-path", str(broken), "--bootstrap-servers", "127.0.0.1:9", "--port",
                        str(port), "--state-dir", str(tmp_path / f"state-{instances}"), "--instances", instances,
                        timeout=90)
        lines = ended.stderr.strip().splitlines()
        failed = f"trajbus gateway: --tokenizer-path {broken}: the tokenizer failed to load: JSONDecodeError: "
        assert ended.returncode == 2 and "Traceback" not in ended.stderr, ended.stderr
        if instances == "1":
            assert lines[-1].startswith(failed), ended.stderr
        else:  # each instance says why, then the fleet stops: never forked again
            assert any(line.startswith(failed) for line in lines), ended.stderr
            assert ended.stderr.count("gateway instance started") == 2, ended.stderr
