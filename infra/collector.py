"""Python's cycle collector, set for a long-running server that holds token ids as Python lists.

A gateway call holds an 8k-id prompt list while it waits on the engine, and every open trajectory keeps
its context ids. CPython's default thresholds (700, 10, 10) run a young collection each time 700 more
containers are alive than at the last, and each one walks those lists element by element again; every few
seconds a full one walks every trajectory's ids. Measured in the gateway at 256 agents (``benchmarks.gateway_bench``'s
conversations, a ``gc.callbacks`` probe, 5-8k calls a setting): the defaults spent **1.4 ms of the
event loop per call** in the collector, its full collections 216 ms each on average; the thresholds
below 0.11 ms per call, the longest pause 105 ms. Most of what a call allocates is freed by reference
counting and never counts towards the 20,000; the young collections that still come free the few cycles
(asyncio's tasks and exceptions). Freezing the objects built before serving (about 140k: the tokenizer,
transformers, the app) keeps full collections off them.
"""

from __future__ import annotations

import gc

from trajbus.infra.allocator import return_large_blocks

SERVING_THRESHOLDS = (20_000, 10, 10)
"""Only the young generation's threshold is raised: a middle collection every 10 young ones and a full one
every 10 middle ones (and, as always in CPython, only once the long-lived objects grew by a quarter), so
cycles that outlived a young collection are still freed within minutes."""


def tune_for_serving() -> None:
    """Call once the server's long-lived state is built, before it takes calls. The C allocator is set for
    serving too (``infra.allocator``): the calls' large buffers go back to the OS when freed."""
    return_large_blocks()
    gc.collect()  # what startup left as garbage is not frozen with the rest
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)


def freeze_loaded() -> None:
    """Call once long-lived state that loads after ``tune_for_serving`` is built (the gateway's tokenizer loads
    in a thread while the server already answers ``/ready``): full collections then skip it too. Without it,
    every full collection walks the tokenizer's tens of thousands of objects again."""
    gc.freeze()
