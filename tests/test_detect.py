"""Failure detection as an object (elastictrain/controller/detect.py): observations in, Failures out,
no Ray and no controller."""

from __future__ import annotations

from elastictrain.config import TimeoutsConfig
from elastictrain.controller.detect import FailureDetector, WorkerView

T = TimeoutsConfig(watchdog_floor_s=3.0, step_watchdog_cap_s=60.0, watchdog_factor=10.0)
AT = {"last_progress": 100.0, "known_step": 40}


def test_own_error_is_a_failure_peer_failed_is_not() -> None:
    d = FailureDetector(T)
    w0, w1 = WorkerView(0, 0, joined_step=0), WorkerView(1, 1, joined_step=38)
    assert d.on_run_result(w0, {"status": "peer_failed", "error": "RuntimeError: Connection closed by peer"},
                           now=101.0, **AT) is None
    f = d.on_run_result(w1, {"status": "error", "error": "ValueError: bad grad"}, now=101.0, **AT)
    assert (f.slot, f.rank, f.kind, f.reason, f.progress) == (1, 1, "exception", "ValueError: bad grad", 2)
    assert d.on_run_result(w1, {"status": "error", "error": "again"}, now=102.0, **AT) is None  # one per slot
    assert [x.slot for x in d.take()] == [1] and d.take() == []


def test_setup_and_dead_workers() -> None:
    d = FailureDetector(T)
    assert d.report(WorkerView(2, None), "setup_failed", "ImportError", now=1.0, **AT).progress == 0
    assert d.report(WorkerView(3, 1, dead=True), "process_died", "x", now=1.0, **AT) is None


def test_hang_is_a_member_not_answering_polls_past_the_bound() -> None:
    d = FailureDetector(T)
    members = [WorkerView(0, 0, poll_sent_at=199.0), WorkerView(1, 1, poll_sent_at=150.0)]
    # steady steps of 0.5 s: bound 5 s; no progress for 50 s; slot 1's poll is 50 s old
    (f,) = d.find_hangs(members, now=200.0, progress_at=150.0, step_times=[0.5] * 8, **AT)
    assert f.slot == 1 and f.kind == "hang" and "bound 5.0s" in f.reason


def test_hang_is_the_one_computing_while_peers_wait_in_a_collective() -> None:
    d = FailureDetector(T)
    members = [WorkerView(0, 0, phase="collective", phase_since=150.0),
               WorkerView(1, 1, phase="compute", phase_since=150.0)]
    (f,) = d.find_hangs(members, now=200.0, progress_at=150.0, step_times=[0.5] * 8, **AT)
    assert f.slot == 1


def test_a_rank_waiting_on_its_data_is_named_a_data_stall_not_a_hang() -> None:
    """Storage, not the worker: the rank reading its data past the bound is a data stall, and neither it nor
    its peers waiting in the collective for it are hung."""
    d = FailureDetector(T)
    members = [WorkerView(0, 0, phase="collective", phase_since=150.0),
               WorkerView(1, 1, phase="data", phase_since=150.0)]
    assert d.find_hangs(members, now=200.0, progress_at=150.0, step_times=[0.5] * 8, **AT) == []
    assert d.find_data_stalls(members, now=200.0, bound=5.0) == [members[1]]
    assert d.find_data_stalls(members, now=154.0, bound=5.0) == []  # within the bound: a slow read


def test_no_hang_within_the_bound_or_before_warm_up_cap() -> None:
    d = FailureDetector(T)
    members = [WorkerView(0, 0, poll_sent_at=150.0)]
    assert d.find_hangs(members, now=154.0, progress_at=150.0, step_times=[0.5] * 8, **AT) == []
    assert d.find_hangs(members, now=200.0, progress_at=150.0, step_times=[], **AT) == []  # cap is 60 s


def test_blame_names_the_member_whose_part_failed() -> None:
    from elastictrain.controller.detect import CallOutcome, blame

    ok, peer = CallOutcome(0, "ok"), CallOutcome(2, "peer", "RuntimeError: Connection closed by peer")
    own = CallOutcome(1, "own", "ValueError: bad snapshot")
    dead = CallOutcome(3, "dead", "ActorDiedError: The actor is dead")
    assert blame([ok, own, peer]) == [own]          # not the first member, not the peer's victim
    assert blame([ok, own, peer, dead]) == [dead]   # a death explains the others' errors
    assert blame([ok, CallOutcome(1, "pending"), peer]) == [CallOutcome(1, "pending")]  # hung in the call
    assert blame([ok, CallOutcome(1, "ok")]) == [] and blame([CallOutcome(0, "pending")]) == []
