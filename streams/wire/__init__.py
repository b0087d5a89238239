"""The wire contract, whole and alone: every record on trajbus's topics, its encoding, its headers and
the topics' names (docs/wire-format.md maps each section to its module here).

It imports only the standard library, its codecs and itself. Its codecs are numpy (token arrays),
orjson (JSON records) and cachetools (the prefix encoder's bounded memory); nothing here opens a Kafka
client or imports another part of trajbus (tests/unit/test_import_rules.py checks it). The Kafka I/O
around these records is ``streams.client``; a reader in another language needs only this and
docs/wire-format.md.

- ``records``: the records; ``codec``: their binary encoding; ``prefix``: prompts against a prefix;
  ``versions``: version segments; ``chunks``: the framing of groups too large for one record;
- ``headers``: every header; ``dlq``: the dead-letter headers;
- ``topics``: topic and channel names;
- ``ledger``, ``trained``, ``policy``, ``stats``: the JSON records of the prompt ledger, the trained
  log, the policy versions and the statistics snapshots, and how each folds.
"""
