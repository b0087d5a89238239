"""``trajbus demo``: the whole system doing its real job, configured by YAML.

Brings up a throw-away Kafka broker (or uses ``--bootstrap-servers``), the
stream worker, the local inference server with the tiny model and the gateway.
Env managers roll out black-box agents (official ``openai`` client on a
``base_url``) and white-box agents (token ids through ``/generate``) on the
math and calculator environments; a trainer fetches ``DataProto`` batches,
takes a GRPO step with verl on the tiny model, saves it, has the inference
server load the new weights and publishes the next policy version. Progress is
printed as it goes; the end is a summary table and a plot (PNG and SVG); everything is
torn down, also on Ctrl-C.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.infra import tiny_model
from trajbus.infra.kafka_broker import SHORT_LIVED_JVM_OPTIONS, EmbeddedKafka
from trajbus.infra.logs import log_to_file
from trajbus.pipelines.agents import BlackBoxAgent, WhiteBoxAgent
from trajbus.pipelines.demo_config import DemoConfig, load_demo_config
from trajbus.pipelines.env_manager import EnvConfig, EnvManager, EpisodeScheduler
from trajbus.pipelines.envs import CalculatorEnv, MathEnv
from trajbus.pipelines.global_dataset import GlobalDataset
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.processes import (ServiceProcess, free_port, gateway_process, inference_server_process,
                                         wait_http, worker_process)
from trajbus.pipelines.report import VersionRecord, drops_from_stats, summary_table, write_plot
from trajbus.pipelines.training_state import TrainingState
from trajbus.streams.client.policy import PolicyVersionPublisher
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.stats import summarize
from trajbus.streams.client.snapshots import read_snapshots

STAGES = 6


def say(stage: int, text: str) -> None:
    print(f"[{stage}/{STAGES}] {text}", flush=True)


class Rollouts:
    """The env managers, each on its own thread, rolling out until stopped; every group's episode is
    recorded on the prompt ledger before its envs start it."""

    def __init__(self, config: DemoConfig, gateway: str, tokenizer_path: Path, version: list[int],
                 ledger: PromptLedger) -> None:
        self.ledger = ledger
        """Owned: closed by ``stop``."""
        self.scheduler = EpisodeScheduler(ledger=ledger)
        self.managers: list[EnvManager] = []
        sampling = {"temperature": config.rollout.temperature, "max_tokens": config.rollout.max_tokens}
        env_id = 0
        for group_id, group in enumerate(config.rollout.env_groups):
            dataset = GlobalDataset(config.datasets[group.env])
            for _ in range(group.group_size):
                env = CalculatorEnv(dataset) if group.env == "calculator" else MathEnv(dataset)
                agent = (BlackBoxAgent(gateway, sampling=sampling) if group.agent == "black_box" else
                         WhiteBoxAgent(gateway, str(tokenizer_path), policy_version=lambda: version[0],
                                       sampling=sampling))
                self.managers.append(EnvManager(env, agent, self.scheduler,
                                                EnvConfig(group_id, env_id, group.group_size)))
                env_id += 1
        self.pool = ThreadPoolExecutor(len(self.managers), thread_name_prefix="env")
        self.futures = []
        self.seed = config.seed

    def start(self) -> None:
        self.futures = [self.pool.submit(m.run_rollout_loop, {"seed": self.seed}) for m in self.managers]

    def failure(self) -> BaseException | None:
        return next((f.exception() for f in self.futures if f.done() and f.exception()), None)

    def episodes(self) -> int:
        return sum(len(m.episodes) for m in self.managers)

    def stop(self) -> None:
        self.scheduler.stop()
        for manager in self.managers:
            manager.stop()
        self.pool.shutdown(wait=True, cancel_futures=True)  # episodes in flight finish (bounded by max_turns)
        for manager in self.managers:
            manager.agent.close()
        self.ledger.close()


@dataclass
class DemoOutcome:
    """What a finished demo measured (for the pacing benchmark)."""

    records: list[VersionRecord] = field(default_factory=list)
    drops: dict[str, float] = field(default_factory=dict)
    refusals: int = 0
    held: int = 0
    episodes: int = 0
    seconds: float = 0.0


def start_services(config: DemoConfig, bootstrap_servers: str, prefix: str, workdir: Path, policy_dir: Path,
                   services: list[ServiceProcess]) -> tuple[str, str]:
    """Worker, inference server and gateway (appended to ``services`` as they start); their URLs once ready."""
    group_size = config.rollout.env_groups[0].group_size
    services.append(worker_process(bootstrap_servers, prefix, workdir / "worker.log", channels="train",
                                   n_rollouts=group_size, extra=config.worker_flags()).start(own_session=True))
    server_port, gateway_port = free_port(), free_port()
    server = inference_server_process(server_port, workdir / "inference.log", policy_dir).start(own_session=True)
    services.append(server)
    gateway = gateway_process(bootstrap_servers, prefix, [f"127.0.0.1:{server_port}"], policy_dir, gateway_port,
                              workdir / "gateway-state", workdir / "gateway.log", config.gateway_flags())
    gateway.start(own_session=True)
    services.append(gateway)
    server_url, gateway_url = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{gateway_port}"
    wait_http(f"{server_url}/health", 180, server)
    wait_http(f"{gateway_url}/ready", 180, gateway)
    return server_url, gateway_url


def train(config: DemoConfig, bootstrap_servers: str, prefix: str, policy_dir: Path, server_url: str,
          publisher: PolicyVersionPublisher, rollouts: Rollouts, version: list[int], gateway_url: str
          ) -> tuple[list[VersionRecord], dict[int, list[float]]]:
    """GRPO steps on fetched batches until the last policy version; per version what it used and how long
    it waited for the batch, and the rewards by the version that generated each rollout. Each update goes
    through the gateway (``PolicyVersionPublisher.update``): generations in flight are cut and continue
    under the new weights, their tokens labelled with the version that sampled them."""

    def load_weights() -> None:
        httpx.post(f"{server_url}/update_weights_from_disk", json={"model_path": str(policy_dir)},
                   timeout=120).raise_for_status()

    from trajbus.pipelines.trainer import GRPOTrainer

    trainer = GRPOTrainer(policy_dir, config.trainer.learning_rate)
    backend = VerlBackend(config.trainer.prompt_length, config.trainer.response_length,
                          pad_token_id=0, row_mode="trajectory", temperature=config.rollout.temperature)
    records: list[VersionRecord] = []
    rewards_by_rollout_version: dict[int, list[float]] = defaultdict(list)
    with BatchConsumer("train", bootstrap_servers, prefix=prefix, backend=backend) as consumer, \
            PromptLedger(bootstrap_servers, "train", prefix) as ledger:
        state = TrainingState(consumer, ledger)  # a real trainer saves state.state_dict() in its checkpoint
        while version[0] < config.policy_versions:
            step_started = time.monotonic()
            batch = consumer.fetch_dataproto(config.trainer.groups_per_step, timeout=config.trainer.fetch_timeout,
                                             current_version=version[0])
            waited = time.monotonic() - step_started
            if batch is None:
                failure = rollouts.failure()
                raise RuntimeError(f"no batch within {config.trainer.fetch_timeout}s"
                                   + (f": a rollout failed: {failure}" if failure else ""))
            stale = batch.non_tensor_batch["staleness"]
            for reward, lag in zip(batch.batch["rm_scores"].sum(-1).tolist(), stale):
                rewards_by_rollout_version[version[0] - int(lag)].append(reward)
            report = trainer.step(batch)
            trainer.save()
            publisher.update(version[0] + 1, load=load_weights, gateways=[gateway_url])
            consumer.commit()
            version[0] += 1
            records.append(VersionRecord(version[0], config.trainer.groups_per_step, report.rows, report.tokens,
                                         report.reward, report.loss, report.nll, float(stale.mean()),
                                         time.monotonic() - step_started, waited))
            say(5, f"policy v{version[0]}: policy loss {report.loss:+.2e}, nll {report.nll:.4f}, "
                   f"batch reward {report.reward:.3f}, {report.rows} rows, staleness {stale.mean():.2f}, "
                   f"{rollouts.episodes()} episodes so far, {state.depth()} prompt groups dispatched and "
                   f"not yet trained")

    return records, rewards_by_rollout_version


@dataclass
class Running:
    """What the demo started so far: ``stop`` tears it all down whatever stage it reached (Ctrl-C too)."""

    broker: EmbeddedKafka | None = None
    services: list[ServiceProcess] = field(default_factory=list)
    rollouts: Rollouts | None = None
    publisher: PolicyVersionPublisher | None = None

    def stop(self) -> None:
        """Rollouts stopped on a thread of their own, then services (in reverse), publisher, broker."""
        if self.rollouts is not None:
            threading.Thread(target=self.rollouts.stop, daemon=True).start()  # never block teardown on an agent
        for service in reversed(self.services):
            service.stop()
        if self.publisher is not None:
            self.publisher.close()
        if self.broker is not None:
            self.broker.stop()
        print("torn down: gateway, inference server, worker" + (" and broker" if self.broker else "") + " stopped",
              flush=True)


def start_broker(running: Running, workdir: Path, bootstrap_servers: str | None) -> str:
    """The given cluster, or a throw-away broker (in ``running`` before it starts, so a failed start is torn
    down too)."""
    if bootstrap_servers is None:
        running.broker = EmbeddedKafka(state_dir=workdir / "broker", jvm_options=SHORT_LIVED_JVM_OPTIONS)
        say(1, f"starting Apache Kafka {running.broker.version} (KRaft, single node) ...")
        bootstrap_servers = running.broker.start().bootstrap_servers
    return bootstrap_servers


def prepare_policy(config: DemoConfig, bootstrap_servers: str, prefix: str, workdir: Path, running: Running) -> Path:
    """The tiny model copied as policy v0, the train channel's topics, and v0 published (the publisher in
    ``running`` before it publishes, so it is closed on any failure)."""
    say(2, "tiny chat model: building from the project's files (cached after the first run) ...")
    policy_dir = workdir / "policy"
    shutil.copytree(tiny_model.build(), policy_dir)
    with StepProducer(bootstrap_servers, settings=config.topic_settings(prefix)) as producer:
        producer.provision("train")
    running.publisher = PolicyVersionPublisher(bootstrap_servers, prefix=prefix)
    running.publisher.publish(0)
    return policy_dir


def finish(config: DemoConfig, bootstrap_servers: str, prefix: str, gateway_url: str, rollouts: Rollouts,
           running: Running, records: list[VersionRecord], rewards_by_rollout_version: dict[int, list[float]],
           started: float, outcome: DemoOutcome | None) -> None:
    """Stop ``rollouts`` (waited for, unlike teardown's; then out of ``running``, so teardown does not stop
    them again), then print the summary and pacing, fill ``outcome`` and write the plot."""
    say(6, "done: stopping rollouts")
    admissions = httpx.get(f"{gateway_url}/statistics", timeout=30).json()["admissions"]
    rollouts.stop()
    refusals = sum(manager.agent.refusals for manager in rollouts.managers)
    generated = rollouts.episodes()
    running.rollouts = None
    drops = drops_from_stats(summarize(read_snapshots(bootstrap_servers, prefix)), "train")
    print()
    print(summary_table(records, rewards_by_rollout_version, drops, time.monotonic() - started))
    held = sum(n for key, n in admissions.items() if key.endswith("/admitted/waited"))
    print(f"pacing: {held:.0f} new trajectories held until the trainer caught up, {refusals} refused (429) and "
          f"retried; {generated} episodes rolled out for {sum(r.rows for r in records)} rows trained on")
    if outcome is not None:
        outcome.records, outcome.drops, outcome.refusals, outcome.held = records, drops, refusals, int(held)
        outcome.episodes, outcome.seconds = generated, time.monotonic() - started
    plots = write_plot(records, config.report)
    print("\nplot of reward and throughput per version: " + ", ".join(str(p.resolve()) for p in plots))


def run_demo(config: DemoConfig | None = None, bootstrap_servers: str | None = None,
             outcome: DemoOutcome | None = None) -> int:
    """The demo's stages in order; whatever was started is torn down on success, error and Ctrl-C alike."""
    config = config or load_demo_config()
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-demo-"))
    log_to_file(workdir / "demo.log")  # the terminal shows the demo's progress, not its libraries
    running = Running()
    started = time.monotonic()
    interrupted = threading.Event()

    def on_interrupt(signum: int, frame: object) -> None:
        interrupted.set()
        raise KeyboardInterrupt

    previous_handler = signal.signal(signal.SIGINT, on_interrupt)
    try:
        bootstrap_servers = start_broker(running, workdir, bootstrap_servers)
        prefix = f"demo-{uuid.uuid4().hex[:6]}"
        say(1, f"broker at {bootstrap_servers}, topics under prefix {prefix}")

        policy_dir = prepare_policy(config, bootstrap_servers, prefix, workdir, running)
        version = [0]

        say(3, "starting the stream worker, the inference server and the gateway ...")
        server_url, gateway_url = start_services(config, bootstrap_servers, prefix, workdir, policy_dir,
                                                 running.services)
        say(3, f"gateway ready at {gateway_url} (logs in {workdir}: demo.log and one per service)")

        ledger = PromptLedger(bootstrap_servers, "train", prefix, policy_version=lambda: version[0])
        rollouts = running.rollouts = Rollouts(config, gateway_url, policy_dir, version, ledger)
        say(4, f"rolling out: {len(rollouts.managers)} env managers in {len(config.rollout.env_groups)} groups")
        rollouts.start()

        say(5, f"training {config.policy_versions} policy versions, {config.trainer.groups_per_step} groups each")
        records, rewards_by_rollout_version = train(config, bootstrap_servers, prefix, policy_dir, server_url,
                                                    running.publisher, rollouts, version, gateway_url)
        finish(config, bootstrap_servers, prefix, gateway_url, rollouts, running, records, rewards_by_rollout_version,
               started, outcome)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: tearing down", flush=True)
        return 130
    except Exception:
        if interrupted.is_set():  # Ctrl-C surfaced as another error inside a library call
            print("\ninterrupted: tearing down", flush=True)
            return 130
        raise
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        running.stop()
