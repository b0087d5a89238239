"""Trainer-side consumers: ready prompt groups as steps (and, later, DataProto batches)."""

from trajbus.consumers.batch_consumer import BatchConsumer, drain
from trajbus.consumers.off_policy import PolicyVersionPublisher

__all__ = ["BatchConsumer", "PolicyVersionPublisher", "drain"]
