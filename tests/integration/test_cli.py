"""Bad input on the command line: one clear line on stderr and exit code 2."""

from __future__ import annotations

import pytest

from tests.helpers import trajbus


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
