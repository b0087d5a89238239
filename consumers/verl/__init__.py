"""verl's fully-async trainer on trajbus: a durable ``MessageQueue`` (and trajbus's ready groups as its source).

verl's rollouter and trainer talk through one Ray actor, ``MessageQueue``; verl keeps it in memory.
``TRAJBUS_VERL_QUEUE=kafka`` on verl's own command swaps in trajbus's (``plugin``), which keeps every
sample on a Kafka topic and its read position with the trainer's checkpoints; ``TRAJBUS_VERL_QUEUE=groups``
also serves the ready groups of any agent that went through trajbus's gateway.
"""
