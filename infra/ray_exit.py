"""Connecting to Ray, and ending a process that did, without a crash at interpreter exit.

Ray 2.60 keeps a driver's GCS client on a process-wide static io context
(``ConnectOnSingletonIoContext`` in Ray's ``src/ray/gcs_rpc_client/gcs_client.cc``:
``static InstrumentedIOContextWithThread io_context("gcs_client_io_service")``).
That client and its gRPC channel outlive ``ray.shutdown()``: once the cluster is
gone, gRPC's executor and event-engine threads keep retrying the connection to the
dead GCS and format every failure (``grpc_core::StatusToString`` ->
``absl::FormatTime`` -> cctz ``LoadTimeZone`` -> ``std::_Hash_bytes`` on a static map).
At interpreter exit those threads race the main thread's C++ static destructors,
and the process can die of SIGSEGV in libstdc++'s string hashing after all its
work succeeded (seen in ``make test``; the traces are in the round's closing note).
No Ray API stops those threads, so a process that connected to Ray shuts Ray down
and then ends with ``os._exit``, after closing everything of its own and flushing
its output: only the C++ static destructors are skipped.

Ray's core worker also installs native handlers for SIGTERM and SIGINT (absl's
failure signal handler) in place of the process's own: a server that connects
keeps its graceful shutdown only if it puts its handlers back (``keep_signal_handlers``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import Any, Iterator

_connected = False


def connect(**options: Any) -> None:
    """``ray.init(**options)``, remembered: this process must then end through ``exit_process``."""
    global _connected
    import ray

    ray.init(**options)
    _connected = True


def connected() -> bool:
    """Whether this process ever connected to Ray through ``connect``."""
    return _connected


def exit_process(status: int) -> int:
    """End now with ``status`` if this process connected to Ray (see the module's docstring);
    otherwise return ``status`` so the caller returns normally."""
    if not _connected:
        return status
    import ray

    ray.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@contextlib.contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Put this process's SIGTERM/SIGINT handlers back after Ray connected inside the block.
    Enter and leave it on the main thread (Python sets signal handlers only there)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
