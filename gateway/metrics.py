"""The gateway's Prometheus metrics (``trajbus_gateway_*``), served at ``/metrics``."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, Summary

from trajbus.gateway import gc_pauses

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf"))


class Children(dict):
    """A labelled metric's children by their label values, each bound once: ``labels()`` checks its arguments and
    takes a lock at every call (about 1 us), which the hot path pays for several metrics a call."""

    def __init__(self, metric: Any) -> None:
        super().__init__()
        self.metric = metric

    def __missing__(self, values: str | tuple[str, ...]) -> Any:
        """The child of one label value (``tokens_of["prompt"]``) or of several (``steps_of[channel, source]``)."""
        child = self[values] = self.metric.labels(*values) if isinstance(values, tuple) else self.metric.labels(values)
        return child


class GatewayMetrics:
    def __init__(self, instance: str, base_url: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Info("trajbus_gateway_instance", "Which gateway of a fleet serves these metrics, and the base of the "
             "URLs it hands out", registry=r).info({"instance": instance, "base_url": base_url})
        self.requests = Counter("trajbus_gateway_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.latency = Histogram("trajbus_gateway_request_seconds", "Request latency by route", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.steps = Counter("trajbus_gateway_steps_published", "Steps acknowledged by the broker",
                             ["channel", "source"], registry=r)
        self.tokens = Counter("trajbus_gateway_tokens", "Prompt and response tokens of published steps",
                              ["kind"], registry=r)
        self.prompts = Counter("trajbus_gateway_prompts", "Black-box prompts: a trajectory's first, one that "
                               "continues its sampled tokens, or one that starts a new segment",
                               ["kind"], registry=r)
        self.trajectories = Counter("trajbus_gateway_trajectories", "Black-box trajectories by event",
                                    ["event"], registry=r)
        self.publish_latency = Histogram("trajbus_gateway_publish_seconds", "Produce-to-acknowledgement time",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.engine_latency = Histogram("trajbus_gateway_engine_seconds", "Time spent in the inference backend",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.backend_up = Gauge("trajbus_gateway_backend_up", "1 while a backend is in service (its health check or its calls answered lately)",
                                ["backend"], registry=r)
        self.admissions = Counter("trajbus_gateway_admissions", "New trajectories admitted (immediately or "
                                  "after waiting) or refused, by reason", ["channel", "outcome", "reason"],
                                  registry=r)
        self.waiting = Gauge("trajbus_gateway_admission_waiting", "New trajectories held by ?wait=, by reason",
                             ["channel", "reason"], registry=r)
        self.backlog = Gauge("trajbus_gateway_backlog_groups", "The trainer's backlog as admission sees it: ready "
                             "groups, groups in flight here and at other gateways", ["channel", "kind"], registry=r)
        self.state_trajectories = Gauge("trajbus_gateway_state_trajectories", "Trajectories in the gateway's "
                                        "state, by status", ["status"], registry=r)
        self.state_bytes = Gauge("trajbus_gateway_state_bytes", "Bytes of the gateway's trajectory state in use",
                                 registry=r)
        self.calls_in_flight = Gauge("trajbus_gateway_calls_in_flight", "Engine calls this instance serves now "
                                     "(at most its --max-concurrent-calls)", registry=r)
        self.heap_releases = Counter("trajbus_gateway_heap_releases", "Times this instance gave its free heap back "
                                     "to the OS, once no engine call was in flight (gateway.http.quiet)", registry=r)
        self.shed = Counter("trajbus_gateway_shed", "Requests answered 503 at once because the gateway was at "
                            "its --max-concurrent-calls", ["route"], registry=r)
        self.generations = Counter("trajbus_gateway_generations", "Engine generations a weight update cut, then "
                                   "continued under the new weights, or ended 503 past --max-pause",
                                   ["event"], registry=r)
        self.cut_tokens = Counter("trajbus_gateway_cut_tokens", "Tokens generations had sampled when a weight "
                                  "update cut them (since any cut before): kept, and continued from", registry=r)
        self.paused = Gauge("trajbus_gateway_paused", "1 while generation is paused for a weight update",
                            registry=r)
        self.pause_seconds = Histogram("trajbus_gateway_pause_seconds", "Time generation was paused, per weight "
                                       "update (pause to resume)", buckets=LATENCY_BUCKETS, registry=r)
        self.reward = Summary("trajbus_gateway_trajectory_reward", "Rewards of finished trajectories",
                              ["policy_version"], registry=r)
        # The hot path's labelled metrics, each child bound once (``Children``), e.g. ``steps_of[channel, source]``:
        self.requests_of, self.latency_of, self.steps_of = (Children(m) for m in (self.requests, self.latency,
                                                                                  self.steps))
        self.tokens_of, self.prompts_of = Children(self.tokens), Children(self.prompts)
        gc_pauses.register(r)  # trajbus_gateway_gc_pause_seconds{generation}, trajbus_gateway_gc_pause_max_seconds
