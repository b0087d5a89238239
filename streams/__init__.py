"""trajbus's records and the stream worker, in three wings.

- ``streams.wire``: the wire contract (records, codec, prefix sharing, topic names,
  version segments, chunks, ledger records): what any reader or writer of the topics
  shares, in any language (docs/wire-format.md).
- ``streams.client``: the client SDK over it (the acknowledged producer, delivery
  reports, dead letters, policy versions, weight updates): what agents and trainers call.
- ``streams.worker``: the Faust stream processor that assembles steps into ready
  prompt groups exactly once (``trajbus worker``).

The wire imports nothing of the other two; the client imports the wire; the worker
imports both.
"""
