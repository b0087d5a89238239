"""When a backend is in service (``gateway.engine.health``): each state and what moves it, without I/O."""

from __future__ import annotations

from trajbus.gateway.engine.health import NEVER, Change, Liveness, ProbeResult

WINDOW = 10.0


def in_service(now: float = 0.0) -> Liveness:
    """A backend that passed its probe at ``now``."""
    backend = Liveness(WINDOW)
    assert backend.probed(ProbeResult.PASSED, now) is Change.READY
    return backend


def test_a_backend_never_seen_healthy_is_waited_for_not_taken_out():
    backend = Liveness(WINDOW)
    assert not backend.in_service and not backend.seen
    assert backend.probed(ProbeResult.FAILED, 1.0) is None  # not up yet: no "taken out"
    assert backend.probed(ProbeResult.SLOW, 2.0) is None
    assert not backend.in_service
    assert backend.probed(ProbeResult.PASSED, 3.0) is Change.READY  # first seen: "ready", not "back in"
    assert backend.in_service and backend.seen
    assert backend.probed(ProbeResult.PASSED, 4.0) is None


def test_a_slow_probe_keeps_a_backend_that_answers_its_calls():
    backend = in_service(0.0)
    for now in range(1, 60):  # calls answered all along, every probe too slow
        backend.answered(now - 0.5)
        change = backend.probed(ProbeResult.SLOW, now)
        assert backend.in_service
        assert change is (Change.KEPT_IN if now == 1 else None)  # said once per slow spell
    assert backend.probed(ProbeResult.PASSED, 60.0) is None and not backend.slow
    assert backend.probed(ProbeResult.SLOW, 61.0) is Change.KEPT_IN  # a new spell is said again


def test_one_slow_probe_right_after_a_passing_one_keeps_an_idle_backend():
    backend = in_service(0.0)
    assert backend.probed(ProbeResult.SLOW, WINDOW) is Change.KEPT_IN  # its passing probe is an answer
    assert backend.in_service


def test_slow_probes_take_out_a_backend_silent_for_the_window():
    backend = in_service(0.0)
    backend.answered(5.0)
    assert backend.probed(ProbeResult.SLOW, 5.0 + WINDOW) is Change.KEPT_IN
    assert backend.probed(ProbeResult.SLOW, 5.0 + WINDOW + 0.1) is Change.TAKEN_OUT  # hung: no answer for the window
    assert not backend.in_service
    assert backend.probed(ProbeResult.SLOW, 30.0) is None


def test_a_backend_taken_out_by_slow_probes_is_back_once_it_answers():
    backend = in_service(0.0)
    assert backend.probed(ProbeResult.SLOW, WINDOW + 1) is Change.TAKEN_OUT
    backend.answered(WINDOW + 2)  # a call sent before it went out got its answer
    assert backend.probed(ProbeResult.SLOW, WINDOW + 3) is Change.BACK_IN and backend.in_service
    assert backend.probed(ProbeResult.SLOW, 2 * WINDOW + 2) is None and backend.in_service  # that answer's window
    assert backend.probed(ProbeResult.SLOW, 2 * WINDOW + 3) is Change.TAKEN_OUT


def test_a_failed_probe_takes_a_backend_out_at_once_despite_its_answers():
    backend = in_service(0.0)
    backend.answered(9.0)
    assert backend.probed(ProbeResult.FAILED, 9.5) is Change.TAKEN_OUT  # refused: the process is gone
    assert not backend.in_service and backend.alive_at == NEVER
    assert backend.probed(ProbeResult.FAILED, 10.0) is None  # said once


def test_a_dead_backend_is_back_only_when_its_probe_passes():
    backend = in_service(0.0)
    backend.answered(9.0)
    backend.probed(ProbeResult.FAILED, 9.5)
    assert backend.probed(ProbeResult.SLOW, 10.0) is None  # restarting, /health slow: its old answers do not count
    assert not backend.in_service
    assert backend.probed(ProbeResult.PASSED, 11.0) is Change.BACK_IN and backend.in_service


def test_a_refused_call_takes_a_backend_out_until_the_next_probe():
    backend = in_service(0.0)
    backend.answered(1.0)
    assert backend.refused() is Change.TAKEN_OUT and not backend.in_service
    assert backend.refused() is None  # said once
    assert backend.probed(ProbeResult.PASSED, 2.0) is Change.BACK_IN


def test_after_a_refused_call_a_slow_probe_puts_back_a_backend_that_answered_lately():
    backend = in_service(0.0)
    backend.answered(1.0)
    backend.refused()  # a connection reset under load: the probe decides
    assert backend.probed(ProbeResult.SLOW, 2.0) is Change.BACK_IN and backend.in_service


def test_a_backend_whose_calls_fail_stays_in_while_its_probe_passes():
    """Answered errors (5xx) are not answers: the pool counts them; the probe keeps the backend in."""
    backend = in_service(0.0)
    for now in range(1, 40):
        assert backend.probed(ProbeResult.PASSED, now) is None and backend.in_service


def test_a_backend_whose_calls_fail_and_probe_is_slow_goes_out_after_the_window():
    backend = in_service(0.0)  # no call answered 200 from here on
    assert backend.probed(ProbeResult.SLOW, 6.0) is Change.KEPT_IN
    assert backend.probed(ProbeResult.SLOW, 12.0) is Change.TAKEN_OUT


def test_a_lost_connection_takes_out_only_a_backend_with_no_answer_lately():
    backend = in_service(0.0)
    backend.answered(5.0)
    assert backend.lost(5.0 + WINDOW) is None and backend.in_service  # busy, answering: kept
    assert backend.lost(5.0 + WINDOW + 0.1) is Change.TAKEN_OUT and not backend.in_service
    assert backend.lost(6.0) is None and not backend.in_service  # a loss never puts one back
    assert backend.probed(ProbeResult.PASSED, 20.0) is Change.BACK_IN
