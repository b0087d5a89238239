"""trajbus's records and the stream worker, in three wings.

- ``streams.wire``: the wire contract (records, codec, prefix sharing, headers, topic
  names, version segments, chunks' framing, the ledger, trained-log, policy and stats
  records): what any reader or writer of the topics shares, in any language
  (docs/wire-format.md).
- ``streams.client``: the client SDK over it (the acknowledged producer, delivery
  reports, dead letters, policy versions, weight updates, chunks and stats snapshots
  on Kafka, the topics' settings): what agents, trainers and tools call.
- ``streams.worker``: the Faust stream processor that assembles steps into ready
  prompt groups exactly once (``trajbus worker``).

The wire imports nothing of trajbus but itself; the client imports the wire and
``infra``; the worker imports both.
"""
