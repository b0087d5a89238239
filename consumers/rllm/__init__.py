"""rLLM's model gateway on trajbus: a ``TraceStore`` that keeps its traces as Steps on Kafka.

``KafkaTraceStore`` implements ``rllm_model_gateway``'s ``TraceStore`` protocol; ``store`` says how to
start rLLM's gateway with it, ``traces`` how a trace maps to a Step.
"""

from trajbus.consumers.rllm.store import KafkaTraceStore

__all__ = ["KafkaTraceStore"]
