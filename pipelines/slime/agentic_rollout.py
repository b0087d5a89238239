"""One data source's agentic rollouts: groups handed out to agents, and the assembled groups taken back.

slime calls its rollout function again and again with the same data source; this object lives as long
as that data source (``pipelines.slime.agentic``). A training rollout:

1. hands groups out (``data_source.get_samples``) while the groups kept and those in flight fall short
   of ``rollout_batch_size``, bringing those in flight up to ``over_sampling_batch_size``
   (``RolloutShape``), and starts their agents (``pipelines.slime.harness``);
2. reads the groups the stream worker assembled, in the order they became ready
   (``pipelines.slime.group_reader``), turns each into slime Samples (``samples_from_group``; each
   trajectory takes the sample whose ``index`` its metadata names), asks the dynamic filter, and keeps
   it until the batch is full (a filtered group is recorded on the ledger with its reason);
3. returns the batch sorted by index; groups still in flight are not aborted: they finish and count
   toward the next rollout (their tokens carry the policy versions that sampled them).

A group whose agent raised is given up: the worker is told (the ledger's abandon event, or the same
event sent directly without a ledger) and decides in order: a group it already emitted is taken as it
is, any other is dropped and its prompt goes back to the data source's buffer (``add_samples``), once.
With a ledger, a group the worker dropped on its own (its filters) leaves the rollout's count too.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from typing import Any

from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.dotted import import_dotted
from trajbus.consumers.slime.sample_kind import SampleKind
from trajbus.pipelines.slime.data_source import SlimeDataSource
from trajbus.pipelines.slime.group_reader import GroupReader
from trajbus.pipelines.slime.harness import SAMPLE_INDEX, AgentHarness, GroupRun
from trajbus.pipelines.slime.rollout_args import RolloutShape, dynamic_filter, eval_sets, sampling_of
from trajbus.consumers.slime.samples import sample_kind, samples_from_group
from trajbus.pipelines.slime.settings import SlimeSettings
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.ledger import ABANDON, ABANDON_TRAJECTORY, DROPPED, Outcome
from trajbus.streams.wire.records import ReadyGroup

__all__ = ["AgenticRollout", "METRIC"]

log = logging.getLogger("trajbus.slime")

POLL = 0.5
"""Seconds one read of the groups topic waits before the rollout looks at its agents again."""
METRIC = "rollout/trajbus/"


def _group_index(samples: list[Any]) -> int:
    return min((s.index for s in samples if s.index is not None), default=0)


class AgenticRollout:
    """Agents for one data source's groups, through trajbus's gateway; their assembled groups as Samples."""

    def __init__(self, settings: SlimeSettings, args: Any, data_source: Any) -> None:
        self.settings, self.data_source = settings, data_source
        self.ledger = data_source.ledger if isinstance(data_source, SlimeDataSource) else None
        if self.ledger is not None and settings.settled_by != "worker":
            raise ValueError("trajbus_settled_by: the agentic rollout's groups are settled by the stream worker "
                             "that assembles them: set trajbus_settled_by: worker in the --custom-config-path YAML")
        if settings.eval_channel == settings.channel:
            raise ValueError(f"trajbus_eval_channel: {settings.eval_channel!r} is the training channel too; "
                             f"evaluation groups need a channel of their own (the default: val)")
        self.bootstrap_servers = resolve_bootstrap_servers(settings.bootstrap_servers)
        agent = import_dotted(settings.agent_path, "trajbus_agent_path")
        if not callable(agent):
            raise ValueError(f"trajbus_agent_path: {settings.agent_path!r} is not callable")
        self.harness = AgentHarness(settings.gateway_url, agent, settings.agent_concurrency, settings.gateway_api_key)
        self.reader = GroupReader(self.bootstrap_servers, settings.prefix, settings.channel, self.ledger)
        self.eval_reader: GroupReader | None = None
        self.tokenizer = _tokenizer(args)
        self.running: dict[str, GroupRun] = {}
        self.given_up: dict[str, GroupRun] = {}
        """Failed groups the worker has not settled yet (a ledger tells): emitted ones are still taken."""
        self.filtered: dict[str, str] = {}
        """prompt_uid -> why the dynamic filter dropped it, until recorded on the ledger."""
        self.eval_prompts: dict[tuple, Any] = {}
        self._producer: StepProducer | None = None

    # -- training ---------------------------------------------------------------------------
    def train(self, args: Any, rollout_id: int) -> tuple[list[list[Any]], dict[str, Any]]:
        """One rollout's batch of groups (slime Samples), and its metrics."""
        metadata = getattr(self.data_source, "metadata", None)
        self.reader.resume(metadata, set(self.running))
        shape, verdict, sampling = RolloutShape.of(args), dynamic_filter(args), sampling_of(args)
        kept: list[list[Any]] = []
        kept_uids: dict[int, str] = {}
        """id(a kept group's Samples) -> its prompt_uid: the batch's groups on the trained log."""
        metrics: Counter = Counter()
        last = time.monotonic()
        while len(kept) < shape.batch:
            in_flight = len(self.running) + len(self.given_up) + len(self.reader.waiting)
            count = shape.to_dispatch(len(kept), in_flight)
            if count:
                self._dispatch(count, rollout_id, sampling)
                last = time.monotonic()
            group = self.reader.next(POLL)
            if group is None:
                self._reap(metrics)
                self._check_stalled(last, self.reader)
                continue
            last = time.monotonic()
            samples = self._claim(group, metrics)
            if samples is None:
                continue
            remaining = len(kept) + len(self.running) + len(self.given_up) + len(self.reader.waiting) + 1
            judged = verdict(samples)
            if judged.keep or (judged.keep_when_insufficient and remaining <= shape.batch):
                kept.append(samples)
                kept_uids[id(samples)] = group.prompt_uid
            else:
                self._filtered(group.prompt_uid, judged.reason, metrics)
        if self.ledger is not None:
            self._record_filtered(timeout=self.settings.ledger_timeout)
        batch = sorted(kept, key=_group_index)
        self.reader.save(metadata, rollout_id, [kept_uids[id(samples)] for samples in batch])
        metrics[METRIC + "groups_in_flight"] = len(self.running) + len(self.given_up)
        return batch, dict(metrics)

    def _dispatch(self, count: int, rollout_id: int, sampling: dict[str, Any]) -> None:
        for group in self.data_source.get_samples(count):
            uid = getattr(group[0], "prompt_uid", None) or \
                f"slime-r{rollout_id}-i{group[0].index}-{secrets.token_hex(4)}"
            for sample in group:
                sample.prompt_uid = uid
            self.running[uid] = self.harness.start(uid, group, self.settings.channel, sampling)

    def _claim(self, group: ReadyGroup, metrics: Counter) -> list[Any] | None:
        """The Samples of a group read: one this process handed out, or (on a ledger) one handed out before a
        resume; any other group on the channel is passed over."""
        uid = group.prompt_uid
        run = self.running.pop(uid, None) or self.given_up.pop(uid, None)
        if run is not None:
            dispatched = run.samples
        elif self.ledger is not None and self._on_ledger(uid):
            dispatched = handed_out(self.data_source, uid)
            metrics[METRIC + "groups_resumed"] += 1
        else:
            log.warning("agentic rollout: passed over group %s on channel %s: this rollout did not hand it out",
                        uid, self.settings.channel)
            return None
        return group_samples(group, dispatched, _kind(self.data_source, dispatched), self.tokenizer)

    def _on_ledger(self, prompt_uid: str) -> bool:
        if prompt_uid not in self.ledger.view.dispatched:
            self.ledger.refresh()
        return prompt_uid in self.ledger.view.dispatched

    def _filtered(self, prompt_uid: str, reason: str | None, metrics: Counter) -> None:
        """slime's metric for a group the dynamic filter dropped; on a ledger, its outcome with the reason."""
        if reason:
            metrics[f"rollout/dynamic_filter/drop_{reason}"] += 1
        metrics[METRIC + "groups_filtered"] += 1
        if self.ledger is not None:
            self.filtered[prompt_uid] = f"filtered: {reason or 'dynamic sampling filter'}"

    def _record_filtered(self, timeout: float = 0.0) -> None:
        """The filtered groups' outcomes on the ledger, each after the worker's ``emitted`` (the newest outcome
        of a prompt is the one that stands, and the worker writes its own just after the group is ready)."""
        deadline = time.monotonic() + timeout
        while self.filtered:
            self.ledger.refresh()
            settled = [uid for uid in self.filtered if uid in self.ledger.view.outcomes]
            if settled:
                self.ledger.write([Outcome(uid, DROPPED, self.filtered.pop(uid)) for uid in settled])
            if not self.filtered or time.monotonic() > deadline:
                return
            time.sleep(0.05)

    # -- agents that failed, groups the worker dropped ---------------------------------------
    def _reap(self, metrics: Counter) -> None:
        """Failed groups given up; on a ledger, the worker's verdicts on finished and given-up groups."""
        for uid, run in list(self.running.items()):
            why = run.failure() if run.done() else None
            if why is not None:
                del self.running[uid]
                metrics[METRIC + "groups_failed"] += 1
                self._give_up(uid, run, why)
        if self.ledger is None:
            return
        self.ledger.refresh()
        self._record_filtered()
        for uid, run in [(uid, run) for uid, run in self.running.items() if run.done()]:
            reason = self.ledger.view.dropped_for(uid)
            if reason is not None:
                del self.running[uid]
                metrics[METRIC + "groups_dropped_by_worker"] += 1
                log.info("agentic rollout: the worker dropped group %s (%s)", uid, reason)
        for uid, run in list(self.given_up.items()):
            if self.ledger.view.dropped_for(uid) is not None:
                del self.given_up[uid]
                self._back_to_buffer(run)

    def _give_up(self, prompt_uid: str, run: GroupRun, why: str) -> None:
        log.warning("agentic rollout: group %s given up, an agent failed: %s", prompt_uid, why)
        if self.ledger is not None:  # the worker decides; _reap reads its verdict
            self.ledger.abandon([prompt_uid], f"agent failed: {why}"[:200])
            self.given_up[prompt_uid] = run
            return
        if self._producer is None:
            self._producer = StepProducer(self.bootstrap_servers, prefix=self.settings.prefix)
        self._producer.complete_trajectory(ABANDON_TRAJECTORY, prompt_uid, channel=self.settings.channel,
                                           metadata={ABANDON: f"agent failed: {why}"[:200]})
        self._back_to_buffer(run)

    def _back_to_buffer(self, run: GroupRun) -> None:
        """The group as handed out back to the data source's buffer: handed out again, once."""
        try:
            self.data_source.add_samples([run.samples])
        except (AttributeError, RuntimeError, ValueError) as exc:
            log.warning("agentic rollout: group %s is lost from this epoch: the data source takes no group back "
                        "(%s)", run.prompt_uid, exc)

    def _check_stalled(self, last: float, reader: GroupReader) -> None:
        waited = time.monotonic() - last
        if waited > self.settings.group_timeout:
            raise TimeoutError(f"agentic rollout: no group of channel {reader.channel!r} became ready in {waited:.0f}s "
                               f"(trajbus_group_timeout) with {len(self.running)} in flight: is a trajbus worker "
                               f"running for it (trajbus worker --channels {reader.channel})?")

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self, args: Any, rollout_id: int) -> dict[str, dict[str, list[Any]]]:
        """Each eval dataset rolled out on the eval channel: its rewards, truncation flags and Samples.
        Without eval datasets (``args`` None: slime's contract test), one group of the data source."""
        if self.eval_reader is None:
            self.eval_reader = GroupReader(self.bootstrap_servers, self.settings.prefix, self.settings.eval_channel)
        sets = eval_sets(args, _kind(self.data_source, []), self.eval_prompts)
        runs: dict[str, tuple[str, GroupRun]] = {}
        for name, groups, sampling in ([(s.name, s.groups, s.sampling) for s in sets] or
                                       [("data_source", self.data_source.get_samples(1), sampling_of(args))]):
            for number, group in enumerate(groups):
                uid = f"eval-r{rollout_id}-{name}-{number}-{secrets.token_hex(4)}"
                runs[uid] = (name, self.harness.start(uid, group, self.settings.eval_channel, sampling))
        results: dict[str, list[Any]] = {name: [] for name, _ in runs.values()}
        self._collect_eval(runs, results)
        self.eval_reader.save(None)
        output = {}
        for name, samples in results.items():
            samples.sort(key=lambda s: s.index)
            output[name] = {"rewards": [s.reward for s in samples], "samples": samples,
                            "truncated": [s.status == s.Status.TRUNCATED for s in samples]}
        return output

    def _collect_eval(self, runs: dict[str, tuple[str, GroupRun]], results: dict[str, list[Any]]) -> None:
        last = time.monotonic()
        while runs:
            group = self.eval_reader.next(POLL)
            if group is None:
                for uid, (name, run) in list(runs.items()):
                    why = run.failure() if run.done() else None
                    if why is not None:
                        log.warning("agentic evaluation: group %s of %s left out, an agent failed: %s", uid, name, why)
                        del runs[uid]
                self._check_stalled(last, self.eval_reader)
                continue
            last = time.monotonic()
            if group.prompt_uid in runs:
                name, run = runs.pop(group.prompt_uid)
                results[name] += group_samples(group, run.samples, _kind(self.data_source, run.samples),
                                               self.tokenizer)

    def close(self) -> None:
        self.harness.close()
        for reader in (self.reader, self.eval_reader):
            if reader is not None:
                reader.close()
        if self._producer is not None:
            self._producer.close()


def _kind(data_source: Any, samples: list[Any]) -> SampleKind:
    """The Sample class to build: the data source's, else that of the samples it handed out, else slime's."""
    kind = getattr(data_source, "kind", None)
    if isinstance(kind, SampleKind):
        return kind
    return SampleKind(type(samples[0])) if samples else sample_kind()


def _tokenizer(args: Any) -> Any:
    """slime's tokenizer (``--hf-checkpoint``), to decode each response; None without one."""
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


def group_samples(group: ReadyGroup, dispatched: list[Any], kind: SampleKind, tokenizer: Any) -> list[Any]:
    """``samples_from_group`` with each trajectory matched to the sample its metadata names (``SAMPLE_INDEX``)."""
    by_index = {sample.index: sample for sample in dispatched}
    named = {step.trajectory_uid: step.metadata.get(SAMPLE_INDEX) for step in group.steps}
    aligned = [by_index.get(named[uid]) for uid in group.trajectory_uids]
    if any(sample is None for sample in aligned):
        aligned = list(dispatched)  # trajectories that name no sample handed out: in order
    return samples_from_group(group.steps, aligned, kind, tokenizer=tokenizer)


def handed_out(data_source: SlimeDataSource, prompt_uid: str) -> list[Any]:
    """A group as the data source handed it out before a resume, rebuilt from the ledger: the prompt at its
    dataset position (or its buffer entry's samples), with its sample indices."""
    view, kind = data_source.ledger.view, data_source.kind
    root = view.root(prompt_uid)
    if root.source == "buffer" and root.origin in view.buffered:
        group = [kind.restore(record) for record in view.buffered[root.origin]]
    else:
        dataset = data_source.dataset
        prompt = None
        if dataset is not None and 0 <= root.offset < len(dataset.origin_samples):
            order = dataset.order(root.epoch) if data_source.args.rollout_shuffle else dataset.origin_samples
            prompt = order[root.offset]
        group = [kind.new(prompt) for _ in root.sample_indices]
        for sample, index in zip(group, root.sample_indices):
            sample.index, sample.group_index = index, root.sample_indices[0] // len(root.sample_indices)
    for sample in group:
        sample.prompt_uid = prompt_uid
    return group
