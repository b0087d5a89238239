"""The wire contract: the records on trajbus's topics, their encoding and the topics' names.

Nothing here talks to Kafka: a reader in another language needs only this and
docs/wire-format.md.
"""
