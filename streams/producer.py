"""``streams.producer``, the name shared/CONTRACT.md gives the producer: it lives in ``streams.client.producer``."""

from trajbus.streams.client.producer import StepProducer

__all__ = ["StepProducer"]
