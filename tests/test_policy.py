"""Pure unit tests of the controller's decisions (elastictrain/controller/policy.py): no Ray, no clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastictrain.config import RecoveryConfig, TimeoutsConfig
from elastictrain.controller.kinds import RULES, Charge, FailureKind
from elastictrain.controller.policy import (
    FailureRecord,
    decide_membership,
    failure_verdict,
    find_stragglers,
    hang_bound,
    pick_source,
    save_membership,
    setup_verdict,
)
from elastictrain.data.cursor import valid_world_sizes

T = TimeoutsConfig(watchdog_floor_s=3.0, step_watchdog_cap_s=60.0, watchdog_factor=10.0)


# ------------------------------------------------------------------------------------------ hang_bound
def test_hang_bound_before_any_step_is_the_cap() -> None:
    assert hang_bound([], T) == 60.0


@pytest.mark.parametrize(("times", "expected"), [
    ([0.5, 0.5, 0.5], 5.0),       # factor x median
    ([0.01, 0.02, 0.01], 3.0),    # clamped up to the floor
    ([100.0, 100.0], 60.0),       # clamped down to the cap
    ([0.1, 0.5, 99.0], 5.0),      # the median, not the mean: one slow step does not inflate it
])
def test_hang_bound_clamps(times: list[float], expected: float) -> None:
    assert hang_bound(times, T) == pytest.approx(expected)


def test_hang_bound_uses_recent_steps_only() -> None:
    # 100 slow steps long ago, then 32 fast ones: only the last 32 count.
    assert hang_bound([5.0] * 100 + [0.5] * 32, T) == pytest.approx(5.0)


@given(st.lists(st.floats(min_value=0.0, max_value=1e4, allow_nan=False), max_size=80))
def test_hang_bound_always_within_floor_and_cap(times: list[float]) -> None:
    assert T.watchdog_floor_s <= hang_bound(times, T) <= T.step_watchdog_cap_s


# ----------------------------------------------------------------------------------- decide_membership
def _decide(**kw):
    args = dict(available=2, current=2, mode="elastic", min_workers=1, max_workers=4, global_batch=16,
                micro_batch=2, waiting_since=None, now=1000.0, wait_limit_s=60.0)
    args.update(kw)
    return decide_membership(**args)


def test_elastic_takes_largest_valid_world_size() -> None:
    # G=16, m=2: valid sizes 1, 2, 4, 8; with 3 available the largest that fits is 2 (3 does not divide).
    d = _decide(available=3, max_workers=8)
    assert (d.action, d.world_size) == ("go", 2)
    assert "3 workers available" in d.reason


def test_elastic_never_exceeds_max() -> None:
    d = _decide(available=16, max_workers=4)
    assert (d.action, d.world_size) == ("go", 4)


def test_elastic_respects_min_workers() -> None:
    # min 4: one or two workers are not enough, even though 1 and 2 divide the batch.
    d = _decide(available=2, min_workers=4, max_workers=8)
    assert (d.action, d.world_size) == ("wait", 4)
    assert "2 available, 4 needed" in d.reason


def test_elastic_waits_for_the_smallest_valid_size_above_min() -> None:
    # G=12, m=1, min=5: valid sizes >= 5 are 6 and 12; need 6.
    d = _decide(available=5, min_workers=5, max_workers=12, global_batch=12, micro_batch=1)
    assert (d.action, d.world_size) == ("wait", 6)


def test_strict_keeps_the_world_size() -> None:
    assert (_decide(mode="strict", available=4, current=2).world_size) == 2
    d = _decide(mode="strict", available=3, current=4)
    assert (d.action, d.world_size) == ("wait", 4)


def test_wait_clock() -> None:
    """Waiting starts at ``waiting_since``; at exactly ``wait_limit_s`` the verdict turns into fail."""
    kw = dict(available=1, min_workers=2, wait_limit_s=60.0, now=1000.0)
    assert _decide(waiting_since=None, **kw).action == "wait"           # not waiting yet: clock at 0
    assert _decide(waiting_since=1000.0 - 59.9, **kw).action == "wait"
    d = _decide(waiting_since=1000.0 - 60.0, **kw)
    assert (d.action, d.world_size) == ("fail", 2)
    assert "min_workers_wait_s=60" in d.reason and "lower workers.min" in d.reason
    assert _decide(mode="strict", current=2, waiting_since=900.0, **{**kw, "min_workers": 1}).action == "fail"


def test_strict_mode_failure_names_a_fix_that_applies_there() -> None:
    """Strict mode waits for its whole world size: with workers.min already live, lowering workers.min
    changes nothing, so the reason must not advise it; it names recovery.mode (issue #21 item 9)."""
    d = _decide(mode="strict", available=3, current=4, min_workers=2, wait_limit_s=60.0, now=1000.0,
                waiting_since=900.0)
    assert d.action == "fail" and d.world_size == 4
    assert "lower workers.min" not in d.reason
    assert "recovery.mode=elastic" in d.reason and "only 3 of the 4 workers" in d.reason


def test_enough_workers_go_even_after_a_long_wait() -> None:
    assert _decide(available=2, min_workers=2, waiting_since=0.0, now=1e6).action == "go"


@st.composite
def _layouts(draw):
    micro = draw(st.integers(1, 8))
    global_batch = micro * draw(st.integers(1, 48))
    max_workers = draw(st.integers(1, 16))
    valid = valid_world_sizes(global_batch, micro, max_workers)
    if not valid:  # no config this small validates; the controller never asks
        max_workers = 1
        valid = [1]
    min_workers = draw(st.sampled_from(valid))
    current = draw(st.sampled_from([w for w in valid if w >= min_workers]))
    return dict(global_batch=global_batch, micro_batch=micro, max_workers=max_workers,
                min_workers=min_workers, current=current)


@settings(max_examples=300, deadline=None)
@given(layout=_layouts(), available=st.integers(0, 40), mode=st.sampled_from(["elastic", "strict"]),
       waited=st.one_of(st.none(), st.floats(0, 200)), limit=st.floats(0.1, 100))
def test_membership_invariants(layout, available, mode, waited, limit) -> None:
    now = 10_000.0
    since = None if waited is None else now - waited
    waited = None if since is None else now - since  # what the policy sees, after float rounding
    d = decide_membership(available=available, mode=mode, waiting_since=since, now=now, wait_limit_s=limit,
                          **layout)
    g, m = layout["global_batch"], layout["micro_batch"]
    assert d.action in ("go", "wait", "fail")
    assert g % (d.world_size * m) == 0, d
    assert layout["min_workers"] <= d.world_size <= layout["max_workers"], d
    assert d.reason
    if d.action == "go":
        assert d.world_size <= available
        if mode == "strict":
            assert d.world_size == layout["current"]
        else:  # the largest valid size that fits
            assert all(w <= d.world_size or w > available for w in valid_world_sizes(g, m, layout["max_workers"]))
    else:
        assert available < d.world_size  # wait/fail only when too few workers
        assert (d.action == "fail") == (waited is not None and waited >= limit)


# ------------------------------------------------------------------------------------- failure_verdict
R = RecoveryConfig(max_failures=5, failure_window_s=100.0, max_failures_per_rank=2, progress_steps=3)


def _f(at: float, slot: int | None = 0, progress: int = 10, kind: FailureKind = FailureKind.PROCESS_DIED,
       reason: str = "boom"):
    return FailureRecord(at=at, slot=slot, kind=kind, reason=reason, progress=progress)


def test_failures_within_budget_keep_recovering() -> None:
    assert failure_verdict([], 0.0, R) is None
    five = [_f(t, slot=t % 3) for t in range(5)]
    assert failure_verdict(five, 5.0, R) is None  # limits are inclusive


def test_failure_rate_budget_spent_within_the_window() -> None:
    six = [_f(t * 10.0, slot=t) for t in range(6)]
    why = failure_verdict(six, 50.0, R)
    assert why is not None and "6 failures within 100s" in why and "recovery.max_failures=5" in why
    assert "failure_window_s=100" in why and "boom" in why


def test_old_failures_leave_the_window() -> None:
    """A long run's ordinary failures, spread out, never spend the budget: 50 failures, 30 s apart."""
    many = [_f(t * 30.0, slot=1) for t in range(50)]
    assert failure_verdict(many, many[-1].at, R) is None


def test_crash_loop_is_failures_in_a_row_without_progress() -> None:
    loop = [_f(t, slot=3, progress=0, kind=FailureKind.SETUP_FAILED, reason="ImportError: no module x") for t in range(3)]
    why = failure_verdict(loop, 3.0, R)
    assert why is not None and "slot 3" in why and "crash loop" in why and "max_failures_per_rank=2" in why
    assert "without progress" in why and "ImportError: no module x" in why


def test_progress_resets_the_crash_loop_count() -> None:
    # slot 1 fails twice without progress, then trains (progress 50) and fails, then once more without.
    seq = [_f(0, 1, 0), _f(1, 1, 2), _f(2, 1, 50), _f(3, 1, 0), _f(4, 1, 1)]
    assert failure_verdict(seq, 4.0, R) is None
    assert failure_verdict(seq + [_f(5, 1, 0)], 5.0, R) is not None


def _verdict_by_lists(records, now, cfg):
    """The crash-loop budget as first written (a list per slot's streak, rebuilt per record): the
    reference the counting version must agree with."""
    recent = [r for r in records if now - r.at <= cfg.failure_window_s]
    if len(recent) > cfg.max_failures:
        return ("rate", len(recent), recent[-1].reason)
    streaks = {}
    for r in records:
        streaks[r.slot] = streaks.get(r.slot, []) + [r] if r.progress < cfg.progress_steps else []
    for slot in sorted(streaks, key=lambda s: -1 if s is None else s):
        if len(streaks[slot]) > cfg.max_failures_per_rank:
            return ("loop", slot, len(streaks[slot]), streaks[slot][-1].reason)
    return None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([None, 0, 1, 2, 7]), st.integers(0, 6)), max_size=30))
def test_the_crash_loop_count_agrees_with_the_streak_lists(seq) -> None:
    """The budget counts each slot's streak (O(log) per call: a recovery of 200 failures judges each in
    turn) instead of rebuilding its list per record; the verdict and its words are the same."""
    cfg = RecoveryConfig(max_failures=10 ** 6, failure_window_s=100.0, max_failures_per_rank=2, progress_steps=3)
    records = [_f(float(i), slot, progress, reason=f"error {i}") for i, (slot, progress) in enumerate(seq)]
    want = _verdict_by_lists(records, float(len(records)), cfg)
    got = failure_verdict(records, float(len(records)), cfg)
    if want is None:
        assert got is None
    else:
        _, slot, n, reason = want
        who = "the worker group" if slot is None else f"worker slot {slot}"
        assert got is not None and got.startswith(f"{who} failed {n} times in a row") and got.endswith(reason)


def test_group_failures_count_as_their_own_slot() -> None:
    seq = [_f(t, slot=None, progress=0, kind=FailureKind.GROUP_FAILED) for t in range(3)]
    why = failure_verdict(seq, 3.0, R)
    assert why is not None and "the worker group" in why


def test_crash_loop_reports_lowest_slot_first() -> None:
    seq = [_f(t, slot=s, progress=0) for t in range(3) for s in (4, 1)]
    assert "slot 1 " in failure_verdict(seq, 3.0, RecoveryConfig(max_failures=50, max_failures_per_rank=2))


def test_setup_verdict_stops_a_deterministic_setup_failure() -> None:
    same = [_f(0, s, 0, FailureKind.SETUP_FAILED, "FileNotFoundError: x.parquet") for s in range(3)]
    why = setup_verdict(same, slots=3, any_setup_ok=False)
    assert why is not None and "every worker (3)" in why and "FileNotFoundError: x.parquet" in why
    assert setup_verdict(same[:2], slots=3, any_setup_ok=False) is None  # slot 2 may still succeed
    assert setup_verdict(same, slots=3, any_setup_ok=True) is None  # it worked somewhere: not deterministic
    mixed = same[:2] + [_f(0, 2, 0, FailureKind.SETUP_FAILED, "MemoryError")]
    assert setup_verdict(mixed, slots=3, any_setup_ok=False) is None


# ------------------------------------------------------------------------------------ find_stragglers
def test_straggler_found() -> None:
    times = {0: [1.0] * 8, 1: [1.1] * 8, 2: [3.5] * 8}
    out = find_stragglers(times, factor=2.0, window=8)
    assert set(out) == {2}
    assert "rank 2" in out[2] and "straggler_factor=2" in out[2]


def test_no_straggler_at_exactly_the_factor() -> None:
    assert find_stragglers({0: [1.0] * 4, 1: [2.0] * 4}, factor=2.0, window=4) == {}


def test_stragglers_need_a_full_window_and_peers() -> None:
    assert find_stragglers({0: [1.0] * 8, 1: [9.0] * 7}, factor=2.0, window=8) == {}  # rank 1: window not full
    assert find_stragglers({0: [9.0] * 8}, factor=2.0, window=8) == {}
    assert find_stragglers({}, factor=2.0, window=8) == {}


def test_stragglers_judge_the_recent_window() -> None:
    # rank 1 was slow long ago and is fast now; rank 0 became slow.
    times = {0: [1.0] * 10 + [5.0] * 4, 1: [9.0] * 10 + [1.0] * 4, 2: [1.0] * 14}
    assert set(find_stragglers(times, factor=2.0, window=4)) == {0}


def test_zero_peer_times_flag_nobody() -> None:
    assert find_stragglers({0: [0.0] * 4, 1: [0.0] * 4, 2: [1.0] * 4}, factor=2.0, window=4) == {}


# ----------------------------------------------------------------------------------------- pick_source
def test_pick_source_most_advanced() -> None:
    assert pick_source({0: 10, 1: 12, 2: 11}) == 1


def test_pick_source_ties_go_to_lowest_rank() -> None:
    assert pick_source({3: 7, 1: 7, 2: 7, 0: 5}) == 1


def test_pick_source_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="no rank holds training state"):
        pick_source({})


@given(st.dictionaries(st.integers(0, 64), st.integers(0, 1000), min_size=1))
def test_pick_source_property(steps: dict[int, int]) -> None:
    r = pick_source(steps)
    assert steps[r] == max(steps.values())
    assert all(q > r for q, s in steps.items() if s == steps[r] and q != r)


def test_save_membership_takes_the_largest_valid_world_whatever_the_mode():
    """Preempted while recovering: any world size the plan runs at can save (a checkpoint reshards)."""
    from elastictrain.parallel.layout import LayoutSpec

    assert save_membership(available=1, spec=LayoutSpec("ddp", 16, 4)).world_size == 1
    assert save_membership(available=3, spec=LayoutSpec("ddp", 16, 4)).world_size == 2  # 16 = 4 x 2 x 2
    hsdp = save_membership(available=3, spec=LayoutSpec("hsdp", 16, 2, shard_size=2))
    assert hsdp.action == "go" and hsdp.world_size == 2, hsdp
    none = save_membership(available=0, spec=LayoutSpec("ddp", 16, 4))
    assert none.action == "fail" and "nothing to save" in none.reason


def test_budget_counts_a_lost_node_once() -> None:
    from elastictrain.controller.policy import FailureRecord, budget_records

    def rec(slot, kind=FailureKind.NODE_LOST, node="n1", progress=0):
        return FailureRecord(1.0, slot, kind, "died", progress, node if kind is FailureKind.NODE_LOST else None)

    new = [rec(0, progress=2), rec(1, kind=FailureKind.EXCEPTION), rec(2, progress=9), rec(3, node="n2")]
    got = budget_records(new, [])
    assert [(r.kind, r.slot, r.node) for r in got] == [("node_lost", 0, "n1"), ("exception", 1, None),
                                                       ("node_lost", 3, "n2")]
    assert got[0].progress == 9 and "lost with 2 workers (slots [0, 2])" in got[0].reason
    assert budget_records([rec(5), rec(6, node="n3")], got) == [rec(6, node="n3")]  # n1 was charged already
    # two 8-worker nodes lost in the window stay within the default budget
    log = budget_records([rec(i, node="a") for i in range(8)], [])
    log += budget_records([rec(i, node="b") for i in range(8)], log)
    assert len(log) == 2 and failure_verdict(log, 2.0, RecoveryConfig()) is None


def test_elastic_membership_under_tp_keeps_whole_tp_groups_and_pipelines() -> None:
    """tp is a factor of the plan resolution: fewer workers than the layout needs shrink to the largest
    world of whole TP groups (and whole pipelines of them); too few for one group waits."""
    from elastictrain.parallel.layout import LayoutSpec

    def decide(spec: LayoutSpec, available: int, max_workers: int) -> tuple[str, int]:
        m = decide_membership(available=available, current=max_workers, mode="elastic", min_workers=1,
                              max_workers=max_workers, global_batch=spec.global_batch,
                              micro_batch=spec.micro_batch, waiting_since=None, now=0.0,
                              wait_limit_s=60, spec=spec)
        return m.action, m.world_size

    tp2 = LayoutSpec("ddp", 16, 2, tp=2)
    assert decide(tp2, 3, 4) == ("go", 2)   # tp2 x dp2 lost one: tp2 x dp1, the spare rank waits
    assert decide(tp2, 4, 4) == ("go", 4)   # grows back once the replacement is ready
    assert decide(tp2, 1, 4) == ("wait", 2)  # not one whole TP group
    assert decide(LayoutSpec("ddp", 16, 2, tp=2, pp=2), 7, 8) == ("go", 4)  # one pipeline of TP groups
    assert decide(LayoutSpec("fsdp", 16, 2, tp=2), 5, 6) == ("go", 4)


# ------------------------------------------------------------------------------------- failure kinds
def test_failure_kinds_keep_their_words_in_events_and_json(tmp_path) -> None:
    """A kind is an enum in the code and the same word in events.jsonl, on the console and in JSON."""
    import json

    from elastictrain.events import EventLog, format_event, read_events

    words = {"process_died", "hang", "exception", "straggler", "node_lost", "setup_failed", "group_failed"}
    assert {k.value for k in FailureKind} == words and set(RULES) == set(FailureKind)
    log = EventLog(tmp_path, console=None)
    for k in FailureKind:
        log.emit("failure", kind=k, rank=None, slot=None, node_id=None, detected_after_s=0.0, step=0, reason="x")
    log.close()
    got = [e["kind"] for e in read_events(tmp_path) if e["event"] == "failure"]
    assert got == [k.value for k in FailureKind]
    assert json.dumps({"kind": FailureKind.NODE_LOST}) == '{"kind": "node_lost"}'
    assert "node_lost" in format_event({"event": "failure", "time": 0.0, "kind": FailureKind.NODE_LOST})
    assert FailureRecord(0.0, 1, "hang", "x", 0).kind is FailureKind.HANG  # a word from JSON becomes the kind
    with pytest.raises(ValueError):
        FailureRecord(0.0, 1, "hung", "x", 0)


def test_each_kind_is_charged_by_its_one_rule() -> None:
    """The budget asks the kind (kinds.RULES), not a list of words: a death or a hang on a gone node is the
    node's loss, charged once per node; a set-up failure alone feeds the deterministic set-up verdict."""
    from elastictrain.controller.policy import budget_records, setup_verdict

    assert {k for k in FailureKind if k.seen_on(node_alive=False) is FailureKind.NODE_LOST} == {
        FailureKind.PROCESS_DIED, FailureKind.HANG, FailureKind.NODE_LOST}
    assert all(k.seen_on(node_alive=True) is k for k in FailureKind)
    assert FailureKind.NODE_LOST.charge is Charge.NODE and FailureKind.SETUP_FAILED.charge is Charge.SETUP
    assert FailureKind.GROUP_FAILED.charge is Charge.GROUP
    two = [FailureRecord(0.0, s, FailureKind.NODE_LOST, "gone", 0, "n1") for s in (0, 1)]
    assert len(budget_records(two, [])) == 1
    same = [FailureRecord(0.0, s, k, "E", 0) for s, k in ((0, FailureKind.SETUP_FAILED), (1, FailureKind.EXCEPTION))]
    assert setup_verdict(same, 2, False) is None  # an exception is not a set-up failure
    assert setup_verdict([FailureRecord(0.0, s, FailureKind.SETUP_FAILED, "E", 0) for s in (0, 1)], 2, False)
