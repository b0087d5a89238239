"""`trajbus demo`: the real RL loop end to end, and its bad input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.helpers import trajbus

DATA = Path(__file__).resolve().parents[2] / "pipelines" / "data"


def config(tmp_path: Path, **changes) -> Path:
    settings = {
        "seed": 3, "policy_versions": 2,
        "datasets": {"math": str(DATA / "math.jsonl"), "calculator": str(DATA / "calculator.jsonl")},
        "rollout": {"max_tokens": 24, "env_groups": [{"env": "math", "agent": "black_box", "group_size": 2},
                                                     {"env": "calculator", "agent": "black_box", "group_size": 2},
                                                     {"env": "math", "agent": "white_box", "group_size": 2}]},
        "trainer": {"groups_per_step": 2, "fetch_timeout": 120},
        "report": str(tmp_path / "report.png"),
    }
    for key, value in changes.items():
        settings[key] = value
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def test_demo_trains_policy_versions_through_the_whole_system(bootstrap_servers, tmp_path, tiny_model_dir):
    result = trajbus("demo", "--config", str(config(tmp_path)), "--bootstrap-servers", bootstrap_servers, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "[5/6] policy v1:" in out and "[5/6] policy v2:" in out
    table = out[re.search(r"version +groups", out).start():].splitlines()
    rows = [line.split() for line in table[2:4]]  # after the header and its rule
    assert [r[0] for r in rows] == ["1", "2"] and all(r[1] == "2" for r in rows), table
    assert rows[0][7] != rows[1][7], "the policy's loss (nll of its rollouts) changes between versions"
    assert "reward by the policy version that generated the rollout: v0:" in out
    assert "queue_full" not in out[out.index("groups dropped by reason"):].splitlines()[0]  # paced: nothing wasted
    assert "new trajectories held until the trainer caught up" in out
    assert "torn down" in out
    png = (tmp_path / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    svg = (tmp_path / "report.svg").read_text()
    assert '<g id="reward">' in svg and '<g id="tokens/s">' in svg and "policy version" in svg


@pytest.mark.parametrize("change, says", [
    ({"rollout": "[unclosed"}, None),
    ({"datasets": {"math": "/nowhere/math.jsonl", "calculator": str(DATA / "calculator.jsonl")}},
     "datasets.math: prompt_data: no such file '/nowhere/math.jsonl'"),
    ({"worker": {"group_filter": "no_such_module.keep"}}, "worker.group_filter: cannot import 'no_such_module.keep'"),
    ({"trainer": {"batch": 3}}, "trainer.batch: unknown setting"),
    ({"policy_versions": 0}, "policy_versions: expected a positive integer"),
])
def test_bad_demo_config_is_one_line_and_exit_2(tmp_path, change, says):
    path = config(tmp_path, **change)
    if says is None:
        path.write_text("rollout: [unclosed\n")
        says = "is not valid YAML"
    result = trajbus("demo", "--config", str(path), timeout=60)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_dataset_record_without_a_label_is_named(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "What is 1 + 1?", "label": "2"}\n{"prompt": "What is 2 + 2?"}\n')
    path = config(tmp_path, datasets={"math": str(broken), "calculator": str(DATA / "calculator.jsonl")})
    result = trajbus("demo", "--config", str(path), timeout=60)
    assert result.returncode == 2 and "datasets.math: record 2" in result.stderr and "'label'" in result.stderr
    assert trajbus("demo", "--config", str(tmp_path / "missing.yaml")).returncode == 2


def test_ctrl_c_tears_everything_down(bootstrap_servers, tmp_path, tiny_model_dir):
    import os
    import re
    import signal
    import subprocess
    import sys
    import threading

    from tests.helpers import wait_for

    path = config(tmp_path, policy_versions=1000)
    errors = tmp_path / "demo.stderr"
    with open(errors, "w") as stderr:
        demo = subprocess.Popen([sys.executable, "-m", "trajbus.pipelines.cli", "demo", "--config", str(path),
                                 "--bootstrap-servers", bootstrap_servers], stdout=subprocess.PIPE,
                                stderr=stderr, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(demo.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("policy v1:" in line for line in lines), 300, "the first policy version")
        workdir = re.search(r"logs in (\S+): demo.log", "".join(lines)).group(1)
        os.killpg(demo.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        assert demo.wait(90) == 130, errors.read_text()[-3000:]
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    reader.join(10)
    assert "interrupted: tearing down" in "".join(lines) and "torn down" in "".join(lines)
    left = subprocess.run(["pgrep", "-f", workdir], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the demo still running: {left}"
