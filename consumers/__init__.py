"""Trainer-side consumers: ready prompt groups as steps (and, later, DataProto batches)."""

from consumers.batch_consumer import BatchConsumer

__all__ = ["BatchConsumer"]
