"""The serving allocator setting (``infra.allocator``), in fresh interpreters: the test process keeps its own."""

import os
import platform
import subprocess
import sys

import pytest

from trajbus.infra.allocator import PRELOAD, mimalloc_library, preloaded

PROBE = """
import sys
from trajbus.infra.allocator import mimalloc_active, release_free_heap, return_large_blocks
setting, size = sys.argv[1], int(sys.argv[2])
assert mimalloc_active() == (setting == "mimalloc")
if setting in ("set", "release"):
    assert return_large_blocks()
if setting == "mimalloc":
    assert not return_large_blocks()  # glibc's setting: nothing to set
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
large, kept = [], []
for _ in range(60_000_000 // size):  # calls' buffers, with what outlives them allocated between them
    large.append(bytearray(size))
    kept.append(bytearray(2_000))
held = rss()
large.clear()
if setting in ("release", "mimalloc"):
    assert release_free_heap()
print((held - rss()) / 60e6)
"""


def returned_share(setting: str, size: int = 100_000) -> float:
    """The share of 60 MB of freed buffers of ``size`` bytes that the process returned to the OS."""
    env = preloaded(os.environ, mimalloc=setting == "mimalloc")
    out = subprocess.run([sys.executable, "-c", PROBE, setting, str(size)], capture_output=True, text=True,
                         timeout=60, check=True, env=env)
    return float(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_large_buffers_freed_between_long_lived_objects_go_back_to_the_os() -> None:
    assert returned_share("set") > 0.9
    assert returned_share("default") < 0.5  # glibc's own: below its threshold (128 KiB, then rising), kept


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the release is glibc's")
def test_smaller_buffers_freed_between_long_lived_objects_go_back_when_the_free_heap_is_released() -> None:
    assert returned_share("set", 50_000) < 0.5  # below the threshold: kept in the heap, between the kept ones
    assert returned_share("release", 50_000) > 0.85  # whole pages inside each freed block


def test_mimalloc_is_preloaded_first_and_once() -> None:
    library = mimalloc_library()
    assert library is not None and os.path.isfile(library)  # the wheel is one of trajbus's dependencies
    assert preloaded({})[PRELOAD] == library
    assert preloaded({PRELOAD: "/opt/other.so"})[PRELOAD] == f"{library}:/opt/other.so"
    assert preloaded(preloaded({PRELOAD: "/opt/other.so"}))[PRELOAD] == f"{library}:/opt/other.so"
    assert preloaded({PRELOAD: f"{library}:/opt/other.so"}, mimalloc=False)[PRELOAD] == "/opt/other.so"
    assert PRELOAD not in preloaded(preloaded({}), mimalloc=False)


@pytest.mark.parametrize("size", [100_000, 50_000])
def test_under_mimalloc_freed_buffers_go_back_to_the_os_when_the_free_heap_is_released(size: int) -> None:
    assert returned_share("mimalloc", size) > 0.85
