"""The names of trajbus's spans and of the attributes they carry.

One vocabulary for the tracer that writes spans (``infra.tracing``, which re-exports it: callers write
``tracing.CALL``) and for the traces topic's format (``infra.trace_export`` keys a span's record by its
``TRAJECTORY_UID``). It imports nothing, so both import it: ``tracing`` builds ``trace_export``'s
exporter, and ``trace_export`` importing ``tracing`` for a name would close a cycle.
"""

from __future__ import annotations

# span names
TRAJECTORY, CALL, ENGINE, PUBLISH = "trajbus.trajectory", "trajbus.call", "trajbus.engine", "trajbus.publish"
APPLY, EMIT, FETCH, CONVERT = "trajbus.apply", "trajbus.emit", "trajbus.fetch", "trajbus.convert"
# attributes
TRAJECTORY_UID, PROMPT_UID, STEP_INDEX = "trajbus.trajectory_uid", "trajbus.prompt_uid", "trajbus.step_index"
CHANNEL, PARTITION, OFFSET = "trajbus.channel", "trajbus.partition", "trajbus.offset"
OUTCOME, BACKEND, TOKENS = "trajbus.outcome", "trajbus.backend", "trajbus.tokens"
