"""The serving allocator setting (``infra.allocator``), in fresh interpreters: the test process keeps its own."""

import platform
import subprocess
import sys

import pytest

PROBE = """
import sys
from trajbus.infra.allocator import release_free_heap, return_large_blocks
setting, size = sys.argv[1], int(sys.argv[2])
if setting != "default":
    assert return_large_blocks()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
large, kept = [], []
for _ in range(60_000_000 // size):  # calls' buffers, with what outlives them allocated between them
    large.append(bytearray(size))
    kept.append(bytearray(2_000))
held = rss()
large.clear()
if setting == "release":
    assert release_free_heap()
print((held - rss()) / 60e6)
"""


def returned_share(setting: str, size: int = 100_000) -> float:
    """The share of 60 MB of freed buffers of ``size`` bytes that the process returned to the OS."""
    out = subprocess.run([sys.executable, "-c", PROBE, setting, str(size)], capture_output=True, text=True,
                         timeout=60, check=True)
    return float(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_large_buffers_freed_between_long_lived_objects_go_back_to_the_os() -> None:
    assert returned_share("set") > 0.9
    assert returned_share("default") < 0.5  # glibc's own: below its threshold (128 KiB, then rising), kept


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the release is glibc's")
def test_smaller_buffers_freed_between_long_lived_objects_go_back_when_the_free_heap_is_released() -> None:
    assert returned_share("set", 50_000) < 0.5  # below the threshold: kept in the heap, between the kept ones
    assert returned_share("release", 50_000) > 0.85  # whole pages inside each freed block
