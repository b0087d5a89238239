"""The prompt ledger's rules: its records, its fold, and a data source resuming from it (against a fake
ledger that keeps the records in a list and settles abandoned prompts as the worker does)."""

from __future__ import annotations

import json

import pytest

from trajbus.pipelines.data_source import DataSourceArgs, RolloutDataSource, RolloutDataSourceWithBuffer, Sample
from trajbus.streams.wire.ledger import (ABANDONED, BufferEntry, Dispatch, LedgerError, LedgerView, Outcome,
                                         decode_record, encode_record)


class FakeLedger:
    """``PromptLedger``'s interface over a list: ``settle_open`` emits the prompts in ``emitted`` and drops
    every other open one as abandoned, as the worker does."""

    channel, prefix = "train", "t"
    bootstrap_servers = "127.0.0.1:1"
    """Never dialled by these tests (a trained log is written only when a rollout is settled)."""

    def __init__(self) -> None:
        self.records: list = []
        self.view = LedgerView()
        self.emitted: set[str] = set()

    def policy_version(self) -> int:
        return 7

    def provision(self) -> None:
        pass

    def refresh(self) -> int:
        self.view = LedgerView()
        for record in self.records:
            self.view.apply(decode_record(*encode_record(record)))
        return len(self.records)

    def write(self, records: list) -> None:
        self.records += records
        self.refresh()

    def abandon(self, prompt_uids: list[str], why: str) -> None:
        self.abandoned = [*getattr(self, "abandoned", []), *prompt_uids]

    def settle_open(self, why: str) -> list[Dispatch]:
        for dispatch in self.view.open():
            placed = [0, len(self.records)] if dispatch.prompt_uid in self.emitted else None
            self.records.append(Outcome(dispatch.prompt_uid, "emitted", placed=placed) if placed else
                                Outcome(dispatch.prompt_uid, "dropped", ABANDONED))
        self.refresh()
        return self.view.due_again()


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": f"q{i}", "label": str(i)}) + "\n" for i in range(6)))
    return path


def args(path, **overrides) -> DataSourceArgs:
    return DataSourceArgs(prompt_data=str(path), label_key="label", n_samples_per_prompt=2, **overrides)


def labels(groups: list[list[Sample]]) -> list[str]:
    return [g[0].label for g in groups]


def test_records_round_trip_and_a_bad_one_is_named():
    dispatch = Dispatch("p-e0-o1", "train", 2, "abc/6", 0, 1, [2, 3], 4)
    for record in (dispatch, Outcome("p-e0-o1", "emitted", placed=[0, 9]), BufferEntry("b1", [{"index": 1}])):
        key, value = encode_record(record)
        assert decode_record(key, value) == record
    assert encode_record(dispatch)[0] == b"dispatch/p-e0-o1"
    with pytest.raises(LedgerError, match="undecodable"):
        decode_record(b"dispatch/x", b"{not json")
    with pytest.raises(LedgerError, match="not <kind>/<name>"):
        decode_record(b"x", b"{}")
    with pytest.raises(LedgerError, match="must be integers"):
        decode_record(*encode_record(Dispatch("x", "train", 2, "a/1", 0, "1", [0])))  # type: ignore[arg-type]


def test_the_fold_knows_what_is_open_due_again_untrained_and_dropped():
    view = LedgerView()
    for record in [Dispatch(f"u{i}", "train", 2, "d/9", 0, i, [2 * i, 2 * i + 1]) for i in range(5)] + [
            Outcome("u0", "emitted", placed=[0, 0]), Outcome("u1", "emitted", placed=[0, 1]),
            Outcome("u2", "dropped", "equal_rewards"), Outcome("u3", "dropped", ABANDONED),
            Dispatch("u3~1", "train", 2, "d/9", 0, 3, [6, 7], source="reissue", origin="u3")]:
        view.apply(record)
    assert [d.prompt_uid for d in view.open()] == ["u4", "u3~1"]
    assert view.due_again() == [] and view.root("u3~1").prompt_uid == "u3"
    assert [view.dropped_for(f"u{i}") for i in range(5)] == [None, None, "equal_rewards", ABANDONED, None]
    assert view.untrained({0: 1}) == 3  # u1 (at offset 1, not yet trained), u4 and u3~1
    assert (view.last_from_dataset.prompt_uid, view.max_sample_index) == ("u4", 9)
    with pytest.raises(LedgerError, match=r"dataset d/9 .* reads other/3"):
        view.check_dataset("other/3")


def test_dispatches_are_recorded_before_the_groups_are_handed_out(prompts):
    ledger = FakeLedger()
    source = RolloutDataSource(args(prompts), ledger=ledger)
    groups = source.get_samples(4)
    assert [d.prompt_uid for d in ledger.records] == [g[0].prompt_uid for g in groups]
    assert all(g[0].prompt_uid == g[1].prompt_uid for g in groups)
    first = ledger.records[0]
    assert (first.epoch, first.offset, first.sample_indices, first.n_rollouts, first.policy_version,
            first.channel) == (0, 0, [0, 1], 2, 7, "train")


def test_a_resume_continues_after_the_last_dispatch_and_issues_the_abandoned_again_once(prompts):
    ledger = FakeLedger()
    before = RolloutDataSource(args(prompts, rollout_shuffle=True), ledger=ledger)
    handed = before.get_samples(4)
    ledger.records.append(Outcome(handed[0][0].prompt_uid, "emitted", placed=[0, 0]))
    ledger.records.append(Outcome(handed[1][0].prompt_uid, "dropped", "equal_rewards"))
    ledger.emitted.add(handed[2][0].prompt_uid)  # emitted, but the crash came before the ledger saw it
    ledger.refresh()
    after = RolloutDataSource(args(prompts, rollout_shuffle=True), ledger=ledger)
    again = after.get_samples(3)
    assert again[0][0].prompt_uid == handed[3][0].prompt_uid + "~1", "the one never settled comes first"
    assert (again[0][0].prompt, [s.index for s in again[0]]) == (handed[3][0].prompt, [6, 7])
    again += after.get_samples(1)
    order = labels(handed) + labels(again[1:])
    assert sorted(order[:6]) == [str(i) for i in range(6)], "the epoch goes on where it stopped"
    assert again[-1][0].prompt_uid.endswith("-e1-o0")
    third = RolloutDataSource(args(prompts, rollout_shuffle=True), ledger=ledger)  # a second crash: all open
    assert [d.prompt_uid for d in third.due] == [g[0].prompt_uid for g in again], \
        "each dispatch left open is abandoned once, and the first one not again"
    assert third.get_samples(1)[0][0].prompt_uid == handed[3][0].prompt_uid + "~2"
    with pytest.raises(LedgerError, match="fingerprint/size"):
        RolloutDataSource(args(prompts, rollout_seed=1, input_key="label"), ledger=ledger)


def test_the_buffer_lives_on_the_ledger(prompts):
    ledger = FakeLedger()
    source = RolloutDataSourceWithBuffer(args(prompts), ledger=ledger)
    aborted = source.get_samples(2)
    aborted[0][0].status = Sample.Status.ABORTED
    aborted[0][0].response = "partial"
    assert source.return_aborted(aborted) == 1
    assert ledger.abandoned == [aborted[0][0].prompt_uid], "the dispatch it came from is given up"
    ledger.emitted.add(aborted[1][0].prompt_uid)
    resumed = RolloutDataSourceWithBuffer(args(prompts), ledger=ledger)
    assert [[s.response for s in g] for g in resumed.buffer] == [["partial", ""]]
    taken = resumed.get_samples(2)
    assert taken[0][0].response == "partial" and taken[0][0].prompt_uid.startswith("b")
    again = RolloutDataSourceWithBuffer(args(prompts), ledger=ledger)
    assert again.buffer == [] and [d.prompt_uid for d in again.due] == [g[0].prompt_uid for g in taken], \
        "the aborted group's first dispatch is not issued again: the buffer took its place"


def test_a_dispatch_the_broker_does_not_acknowledge_hands_nothing_out_and_moves_nothing(prompts):
    ledger = FakeLedger()
    source = RolloutDataSourceWithBuffer(args(prompts), ledger=ledger)
    source.add_samples([[Sample(index=90, prompt="b"), Sample(index=91, prompt="b")]])
    ledger.write = lambda records: (_ for _ in ()).throw(RuntimeError("not acknowledged"))
    with pytest.raises(RuntimeError, match="not acknowledged"):
        source.get_samples(3)
    assert (source.epoch_id, source.sample_offset, source.sample_index, len(source.buffer)) == (0, 0, 0, 1)
    del ledger.write
    groups = source.get_samples(3)
    assert [g[0].prompt for g in groups] == ["b", "q0", "q1"] and groups[0][0].prompt_uid.startswith("b")
    assert [r.origin for r in ledger.records if isinstance(r, Dispatch)][0] == ledger.records[0].entry_id


def test_a_refused_dispatch_across_an_epoch_boundary_leaves_the_epoch_in_its_own_order(prompts):
    ledger = FakeLedger()
    source = RolloutDataSource(args(prompts, rollout_shuffle=True), ledger=ledger)
    first = source.get_samples(4)
    write, ledger.write = ledger.write, lambda records: (_ for _ in ()).throw(RuntimeError("not acknowledged"))
    with pytest.raises(RuntimeError, match="not acknowledged"):
        source.get_samples(4)  # crossed into epoch 1, reshuffled, then refused
    ledger.write = write
    rest = source.get_samples(2)
    assert sorted(labels(first + rest)) == [str(i) for i in range(6)], "epoch 0 is one permutation of the prompts"


class FakeConsumer:
    channel, prefix, topic, group_id, rank, outage_limit = "train", "t", "t.groups.train", "t.trainer.train", 0, None
    bootstrap_servers = "127.0.0.1:1"
    """Never dialled: nothing is handed out, so no step is recorded."""

    def __init__(self) -> None:
        self.positions: dict[int, int] = {0: 2}

    def state_dict(self) -> dict:
        return {"topic": "t.groups.train", "positions": dict(self.positions)}

    def load_state_dict(self, state: dict) -> None:
        self.positions = dict(state["positions"])


def test_training_state_saves_both_positions_and_refuses_a_ledger_that_lost_records(prompts):
    from trajbus.pipelines.training_state import TrainingState

    ledger = FakeLedger()
    ledger.topic, ledger.position = "t.prompts.train", 0
    RolloutDataSource(args(prompts), ledger=ledger).get_samples(3)
    ledger.records += [Outcome(d.prompt_uid, "emitted", placed=[0, i]) for i, d in enumerate(ledger.records)]
    ledger.position = len(ledger.records)
    consumer = FakeConsumer()
    state = TrainingState(consumer, ledger).state_dict()
    assert state["consumer"]["positions"] == {0: 2} and state["ledger"]["offset"] == 6
    assert state["trained"] == {"run": "t.trainer.train", "step": 0}, "no step on record yet"
    assert TrainingState(consumer, ledger).depth() == 1, "the group at offset 2 is emitted, not yet trained"
    consumer.positions = {}
    TrainingState(consumer, ledger).load_state_dict(state)
    assert consumer.positions == {0: 2}
    ledger.position = 4
    with pytest.raises(LedgerError, match="ends at 4, the checkpoint saw 6 records: it was deleted or replaced"):
        TrainingState(consumer, ledger).load_state_dict(state)
