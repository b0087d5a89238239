"""CPU seconds per process over a measured phase, from the kernel's own accounting (user + system).

A benchmark on a 2-core machine shares both cores between the broker, the engine, the
gateway and its own client, so wall time per call says little about who pays for a call.
Each named process and its live descendants (listed by psutil) are read by their CPU-time clocks
(``clock_gettime`` of Linux's ``CPUCLOCK_SCHED``: the scheduler's nanoseconds of all their threads, ended ones
too); only children already reaped are counted from ``/proc``, in clock ticks (10 ms), which would make a 100-call
phase of 2.5 ms calls exact only to 4 %. The benchmark client is this process, read with ``time.process_time()``.
A per-call figure is still an average over a phase's calls, never one call's reading.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil

__all__ = ["CLIENT", "CpuMeter", "Phase"]

CLIENT = "client"
"""The name under which the benchmark's own process (its HTTP client) is reported."""


CPUCLOCK_SCHED = 2
"""Linux's process CPU-time clock of another process: ``clockid = (~pid << 3) | CPUCLOCK_SCHED`` (what glibc's
``clock_getcpuclockid`` returns; Python exposes only the calling thread's)."""


def _clock_seconds(pid: int) -> float:
    """A live process's CPU seconds, user + system, all its threads, to the nanosecond (``OSError`` once gone)."""
    return time.clock_gettime_ns((~pid << 3) | CPUCLOCK_SCHED) / 1e9


def _process_seconds(process: psutil.Process) -> float:
    """User + system seconds of a process, its reaped children (ticks) and its live descendants."""
    try:
        times = process.cpu_times()
        total = _clock_seconds(process.pid) + times.children_user + times.children_system
        for child in process.children(recursive=True):
            try:
                total += _clock_seconds(child.pid)
            except (OSError, psutil.Error):  # ended between the listing and the reading: its time is lost
                pass
        return total
    except (OSError, psutil.Error):
        return 0.0


def _machine_busy_seconds() -> float:
    """Seconds all cores of the machine spent on anything but idling (others' processes too)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


@dataclass
class Phase:
    """What one phase cost: CPU seconds per process, the machine's busy seconds, and the wall time."""

    cpu_s: dict[str, float]
    machine_busy_s: float
    wall_s: float

    def per_call_ms(self, calls: int) -> dict[str, float]:
        """Milliseconds of CPU per call, per process."""
        return {name: 1000 * seconds / calls for name, seconds in self.cpu_s.items()}

    def cores(self) -> dict[str, float]:
        """How many cores each process kept busy on average, and the whole machine (``machine``)."""
        busy = {name: seconds / self.wall_s for name, seconds in self.cpu_s.items()}
        busy["machine"] = self.machine_busy_s / self.wall_s
        return busy

    def summary(self, calls: int) -> dict:
        """The phase as JSON: per-call milliseconds, cores, wall time."""
        return {"calls": calls, "wall_s": self.wall_s, "cpu_ms_per_call": self.per_call_ms(calls),
                "cores": self.cores()}


class CpuMeter:
    """Reads named processes (and this one, as ``client``) before and after a phase."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}

    def snapshot(self) -> tuple[dict[str, float], float, float]:
        """CPU seconds per process, the machine's busy seconds and a wall clock, read now."""
        cpu = {name: _process_seconds(process) for name, process in self.processes.items()}
        cpu[CLIENT] = time.process_time()
        return cpu, _machine_busy_seconds(), time.perf_counter()

    def since(self, before: tuple[dict[str, float], float, float]) -> Phase:
        """The phase from ``before`` (a snapshot) to now."""
        cpu, machine, wall = self.snapshot()
        return Phase(cpu_s={name: cpu[name] - before[0][name] for name in cpu},
                     machine_busy_s=machine - before[1], wall_s=wall - before[2])
