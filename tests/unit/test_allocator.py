"""The serving allocator setting (``infra.allocator``), in fresh interpreters: the test process keeps its own."""

import platform
import subprocess
import sys

import pytest

PROBE = """
import sys
from trajbus.infra.allocator import return_large_blocks
if sys.argv[1] == "set":
    assert return_large_blocks()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
large, kept = [], []
for _ in range(600):  # calls' buffers, with what outlives them allocated between them (a trajectory's state)
    large.append(bytearray(100_000))
    kept.append(bytearray(2_000))
held = rss()
large.clear()
print((held - rss()) / 60e6)
"""


def returned_share(setting: str) -> float:
    """The share of 60 MB of freed 100 KB buffers that the process returned to the OS."""
    out = subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True, timeout=60,
                         check=True)
    return float(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_large_buffers_freed_between_long_lived_objects_go_back_to_the_os() -> None:
    assert returned_share("set") > 0.9
    assert returned_share("default") < 0.5  # glibc's own: below its threshold (128 KiB, then rising), kept
