"""The rules of ``trajbus audit`` (``pipelines.audit``): each prompt's fate, and each violation named."""

from __future__ import annotations

from trajbus.pipelines.audit import audit
from trajbus.streams.wire.ledger import Dispatch, LedgerView, Outcome
from trajbus.streams.wire.trained import GroupRef, TrainedStep


def dispatch(uid: str, source: str = "dataset", origin: str | None = None) -> Dispatch:
    return Dispatch(uid, "train", 2, "fp/4", 0, 0, [0, 1], source=source, origin=origin)


def trained(n: int, *places: tuple[int, int, str], position: dict[int, int]) -> TrainedStep:
    return TrainedStep("run", n, "t.groups.train", [GroupRef(p, o, uid) for p, o, uid in places], position)


def view_of(*records) -> LedgerView:
    view = LedgerView()
    for record in records:
        view.apply(record)
    return view


def fates(report) -> dict[str, tuple[str, list[int], str | None]]:
    return {f.prompt_uid: (f.status, f.steps, f.violation) for f in report.prompts}


def test_a_clean_run_has_every_fate_and_no_violation():
    view = view_of(dispatch("a"), dispatch("b"), dispatch("c"), dispatch("d"), dispatch("c~1", "reissue", "c"),
                   Outcome("a", "emitted", placed=[0, 0]), Outcome("b", "dropped", "filtered: every_13th"),
                   Outcome("c", "dropped", "abandoned"), Outcome("c~1", "emitted", placed=[1, 0]),
                   Outcome("d", "emitted", placed=[0, 1]))
    steps = [trained(1, (0, 0, "a"), position={0: 1}), trained(2, (1, 0, "c~1"), position={0: 1, 1: 1})]
    report = audit("train", "run", view, steps, {(0, 0): "a", (1, 0): "c~1", (0, 1): "d"}, {0: 0, 1: 0})
    assert fates(report) == {"a": ("trained", [1], None), "b": ("dropped", [], None), "c": ("abandoned", [], None),
                             "c~1": ("trained", [2], None), "d": ("waiting", [], None)}
    assert report.violations == [] and report.counts()["trained"] == 2


def test_a_group_trained_at_two_steps_a_skipped_one_and_an_unsettled_prompt_are_each_named():
    view = view_of(dispatch("a"), dispatch("b"), dispatch("c"), dispatch("open"), dispatch("lost"),
                   Outcome("a", "emitted", placed=[0, 0]), Outcome("b", "emitted", placed=[0, 1]),
                   Outcome("c", "emitted", placed=[0, 2]), Outcome("lost", "dropped", "abandoned"))
    steps = [trained(1, (0, 0, "a"), position={0: 1}), trained(2, (0, 2, "c"), position={0: 3}),
             trained(3, (0, 0, "a"), position={0: 1})]
    report = audit("train", "run", view, steps, {}, {0: 0})
    violations = {f.prompt_uid: f.violation for f in report.violations}
    assert violations == {
        "a": "trained twice: steps 1, 3",
        "b": "skipped: the trainer passed 0/1 (position 3) without training it",
        "open": "never settled: dispatched, neither emitted nor dropped",
        "lost": "abandoned and never re-issued"}
    live = audit("train", "run", view, steps, {}, {0: 0}, live=True)
    assert {f.prompt_uid for f in live.violations} == {"a", "b"}, "a run that goes on may have prompts in flight"


def test_a_group_behind_the_trainer_that_the_queue_bound_removed_is_expired_not_skipped():
    view = view_of(dispatch("a"), Outcome("a", "emitted", placed=[0, 4]))
    report = audit("train", "run", view, [trained(1, (0, 9, "z"), position={0: 10})], {}, {0: 6})
    assert fates(report)["a"] == ("expired", [], None)


def test_groups_no_ledger_dispatched_are_audited_from_the_topic_and_the_trained_log():
    steps = [trained(1, (0, 0, "g0"), position={0: 2}), trained(2, (0, 0, "g0"), (0, 2, "g2"), position={0: 3})]
    report = audit("train", "run", LedgerView(), steps, {(0, 0): "g0", (0, 1): "g1", (0, 2): "g2", (0, 3): "g3"},
                   {0: 0})
    assert fates(report) == {"g0": ("trained", [1, 2], "trained twice: steps 1, 2"),
                             "g1": ("skipped", [], "skipped: the trainer passed 0/1 (position 3) without training it"),
                             "g2": ("trained", [2], None), "g3": ("waiting", [], None)}


def test_a_group_trained_in_a_step_a_resume_rolled_back_and_handed_out_again_is_re_issued():
    view = view_of(dispatch("a"), Outcome("a", "emitted"), dispatch("a~1", "reissue", "a"), Outcome("a~1", "emitted"))
    steps = [TrainedStep("run", 3, "", [GroupRef(-1, -1, "a~1")], {})]  # slime's own rollouts: by key only
    report = audit("train", "run", view, steps, {}, {})
    assert fates(report) == {"a": ("re-issued", [], None), "a~1": ("trained", [3], None)}
    assert report.prompts[0].detail == "trained in a step a resume rolled back; re-issued as a~1"
