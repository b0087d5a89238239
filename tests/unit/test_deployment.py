"""Deployment files and the Grafana dashboard use only commands, flags, topics and metrics the code has."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from trajbus.gateway.config import ENV_PREFIX as GATEWAY_ENV
from trajbus.gateway.config import GatewaySettings, settings_from_args
from trajbus.infra.declared import declared_fields, env_var
from trajbus.infra.kafka_config import CONFIG_FILE_VAR, ENV_PREFIX as KAFKA_ENV
from trajbus.pipelines.cli import build_parser
from trajbus.pipelines.demo_config import load_demo_config
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.worker.settings import ChannelSettings, WorkerSettings
from trajbus.streams.worker.settings import ENV_PREFIX as WORKER_ENV

INFRA = Path(__file__).resolve().parents[2] / "infra"


def parses(args: list[str]) -> None:
    """The args are a valid `trajbus` command line (argparse exits on an unknown command or flag)."""
    try:
        build_parser().parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"not a valid trajbus command line: {args} (exit {exc.code})")


def declared_variable(name: str) -> bool:
    """A variable some trajbus component reads: the broker address, a Kafka client property, or a setting."""
    components = ((GatewaySettings, GATEWAY_ENV), (ChannelSettings, WORKER_ENV), (WorkerSettings, WORKER_ENV))
    settings = {env_var(prefix, f.name) for cls, prefix in components for f, _, _ in declared_fields(cls)}
    return name in settings or name in ("TRAJBUS_BOOTSTRAP_SERVERS", CONFIG_FILE_VAR) or name.startswith(KAFKA_ENV)


def test_compose_commands_and_environment_exist_in_the_code():
    compose = yaml.safe_load((INFRA / "deploy" / "compose.yaml").read_text())
    trajbus_services = {name: s for name, s in compose["services"].items() if s.get("image") == "trajbus:latest"}
    assert set(trajbus_services) == {"topics", "worker", "gateway"}
    for name, service in trajbus_services.items():
        parses(service["command"])
        assert "TRAJBUS_BOOTSTRAP_SERVERS" in service["environment"]
        assert all(declared_variable(name) for name in service["environment"]), service["environment"]
    assert compose["services"]["kafka"]["image"] == "apache/kafka:3.9.1"  # the version `trajbus broker` runs
    assert compose["services"]["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
    assert trajbus_services["topics"]["command"][:2] == ["topics", "--create"]
    assert (INFRA / "deploy" / "Dockerfile").read_text().count('ENTRYPOINT ["trajbus"]') == 1


def test_kubernetes_deployments_and_strimzi_topics_match_the_code():
    documents = [d for f in sorted((INFRA / "deploy" / "k8s").glob("*.yaml"))
                 for d in yaml.safe_load_all(f.read_text()) if d]
    deployments = [d for d in documents if d["kind"] in ("Deployment", "StatefulSet")]
    assert {d["metadata"]["name"] for d in deployments} == {"trajbus-gateway", "trajbus-worker"}
    for deployment in deployments:
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            parses(container["args"])
            variables = {e["name"] for e in container["env"]}
            assert "TRAJBUS_BOOTSTRAP_SERVERS" in variables
            assert all(declared_variable(name) for name in variables - {"POD_NAME"}), variables
            credentials = [source["secretRef"] for source in container["envFrom"]]  # TRAJBUS_KAFKA_* of a secret
            assert credentials == [{"name": "trajbus-kafka", "optional": True}]
    gateway = next(d for d in deployments if d["metadata"]["name"] == "trajbus-gateway")
    probes = gateway["spec"]["template"]["spec"]["containers"][0]
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
    # Each pod's base_urls name the pod, through the headless service the StatefulSet is governed by.
    assert gateway["kind"] == "StatefulSet" and gateway["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "state"
    args = probes["args"]
    headless = next(d for d in documents
                    if d["kind"] == "Service" and d["metadata"]["name"] == gateway["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert args[args.index("--public-url") + 1] == f"http://$(POD_NAME).{headless['metadata']['name']}:8100"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in probes["env"]

    topics = {d["spec"]["topicName"]: d["spec"] for d in documents if d["kind"] == "KafkaTopic"}
    expected = {s.name: s for s in TopicSettings().specs(("train", "val"))}
    assert set(topics) == set(expected)
    for name, spec in expected.items():
        assert topics[name]["partitions"] == spec.partitions, name
        assert {k: str(v) for k, v in topics[name]["config"].items()} == spec.config, name


CLOSING_SECONDS = 10
"""What a gateway takes after its drain: the producer flushes what the calls in flight left (they were
acknowledged or cut), the state closes."""


def test_a_gateway_pod_drains_before_it_stops_listening_and_within_its_grace_period():
    """SIGTERM flips /ready at once: the readiness probe must see it within the drain delay (while the pod still
    listens), liveness must not kill the pod while its calls drain, and preStop + drain + closing fit the grace."""
    documents = [d for d in yaml.safe_load_all((INFRA / "deploy" / "k8s" / "gateway.yaml").read_text()) if d]
    pod = next(d for d in documents if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    settings = settings_from_args(build_parser().parse_args(container["args"]))
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["httpGet"] == {"path": "/ready", "port": 8100}
    assert readiness["periodSeconds"] * readiness.get("failureThreshold", 3) < settings.drain_delay
    assert liveness["periodSeconds"] * liveness.get("failureThreshold", 3) >= settings.drain_timeout
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2
    drain = float(command[1]) + settings.drain_delay + settings.drain_timeout + CLOSING_SECONDS
    assert pod["terminationGracePeriodSeconds"] >= drain, "the kubelet would kill the gateway mid-drain"
    defaults = GatewaySettings(vllm_addresses=["h:1"], tokenizer_path="t")
    assert 0 < defaults.drain_delay <= 10, "a gateway drains by default, a few seconds"


def test_the_demo_config_sets_only_declared_worker_and_gateway_settings():
    config = load_demo_config()  # checked against the settings classes on load
    parses(["worker", *config.worker_flags()])
    parses(["gateway", "--vllm-addresses", "h:1", "--tokenizer-path", "t", *config.gateway_flags()])
    assert not declared_variable("TRAJBUS_GATEWAY_PROMPT_LENGHT")


def registered_metric_names() -> set[str]:
    """Metric family names (labelled metrics have no samples until used) and sample names."""
    from prometheus_client import REGISTRY

    import trajbus.consumers.metrics  # noqa: F401  (registers the trainer-side metrics)
    import trajbus.pipelines.ledger  # noqa: F401  (registers the prompt ledger's metrics)
    from trajbus.gateway.metrics import GatewayMetrics
    from trajbus.streams.worker.stats import WorkerMetrics

    names = set()
    for registry in (GatewayMetrics("test", "http://test").registry, WorkerMetrics().registry, REGISTRY):
        for metric in registry.collect():
            names.add(metric.name)
            names.update(sample.name for sample in metric.samples)
    return names


def test_grafana_dashboard_queries_only_metrics_that_exist():
    dashboard = json.loads((INFRA / "grafana" / "trajbus-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\btrajbus_[a-z_]+", target["expr"])}
    known = registered_metric_names()
    suffixes = ("_bucket", "_sum", "_count", "_total")
    missing = {q for q in queried
               if q not in known and not any(q.endswith(s) and q[:-len(s)] in known for s in suffixes)}
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"
    prefixes = {name.split("_")[1] for name in queried}
    assert prefixes == {"gateway", "worker", "groups", "consumer", "ledger"}, "one scheme: trajbus_<component>_*"
