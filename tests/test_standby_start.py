"""Ray's start of a standby process lowered from outside (controller/standby_start.py): the watch finds the
process among its parent's children by a token, puts every thread in SCHED_IDLE at the nice values it has,
and puts it back unless it registered within the bound, or at the take. Real processes, no Ray: this test
process stands in for the raylet (the watched process is its child)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastictrain.controller.standby_start import StartWatch, Verdict, may_put_back, register_bound_s, verdict

# a process with a second thread (Ray's, in a worker) and a token in its command line, that waits for the test
_CHILD = "import sys, threading; threading.Thread(target=sys.stdin.readline, daemon=True).start(); sys.stdin.readline()"


def _classes(pid: int) -> set[tuple[int, int]]:
    """(scheduling policy, nice) of every thread of ``pid`` (policy 5: SCHED_IDLE, 0: SCHED_OTHER)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out.add((int(fields[38]), int(fields[16])))
    return out


def _child(token: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, token], stdin=subprocess.PIPE)


@pytest.fixture
def child(tmp_path):
    procs = []

    def start(token: str) -> subprocess.Popen:
        procs.append(_child(token))
        return procs[-1]

    yield start
    for p in procs:
        p.communicate(b"\n\n", timeout=60)


def test_the_verdict_lowers_a_found_start_and_puts_it_back_only_past_the_bound() -> None:
    assert verdict(0.1, False, False, False, False, 20)[0] is Verdict.LOOK
    assert verdict(0.1, True, False, False, False, 20)[0] is Verdict.LOWER
    assert verdict(5.0, True, True, False, False, 20)[0] is Verdict.WAIT
    assert verdict(20.0, True, True, False, False, 20)[0] is Verdict.PUT_BACK
    assert verdict(20.0, False, False, False, False, 20)[0] is Verdict.DONE  # not on this node: nothing lowered
    assert verdict(25.0, True, True, True, False, 20)[0] is Verdict.DONE  # registered: it stays low
    assert verdict(1.0, True, True, False, True, 20)[0] is Verdict.DONE
    assert register_bound_s(60.0) == 20.0 and register_bound_s(30.0) == 10.0


def test_a_standby_start_is_lowered_until_registered_then_put_back_at_the_take(tmp_path, child) -> None:
    """Found by its token among this process's children (not the other child), every thread in SCHED_IDLE at
    the nice value it had; still there once the registration file appears (the preload's business now);
    the take puts every thread back to SCHED_OTHER at that nice value."""
    other, proc = child("not-it"), child(str(tmp_path / "a.json"))
    if not may_put_back(proc.pid):
        pytest.skip("this user may not take a process out of SCHED_IDLE here: nothing is lowered")
    start = _classes(proc.pid)
    assert {policy for policy, _ in start} == {0}
    watch = StartWatch(os.getpid(), str(tmp_path / "a.json"), str(tmp_path / "a.json"), bound_s=600.0)
    try:
        assert watch.lowered.wait(60), watch.record
        assert watch.record["pid"] == proc.pid
        assert _classes(proc.pid) == {(5, nice) for _, nice in start}
        assert _classes(other.pid) == {(0, nice) for _, nice in _classes(other.pid)}
        (tmp_path / "a.json").write_text("{}")  # what the standby's preload writes once it registered
        assert watch.finished.wait(60)
        assert watch.record["outcome"] == "done" and "registered" in str(watch.record["reason"])
        assert _classes(proc.pid) == {(5, nice) for _, nice in start}
        assert watch.put_back() >= 1
        assert _classes(proc.pid) == start
    finally:
        watch.close()


def test_a_lowered_start_that_does_not_register_within_the_bound_is_put_back(tmp_path, child) -> None:
    """Ray's registration timeout: an idle-class start on busy cores might never register; past the bound
    (here 1 s, never registered) the watch itself puts it back."""
    proc = child(str(tmp_path / "b.json"))
    if not may_put_back(proc.pid):
        pytest.skip("this user may not take a process out of SCHED_IDLE here: nothing is lowered")
    start = _classes(proc.pid)
    watch = StartWatch(os.getpid(), str(tmp_path / "b.json"), str(tmp_path / "b.json"), bound_s=1.0)
    try:
        assert watch.finished.wait(60), watch.record
        assert watch.lowered.is_set() and watch.record["outcome"] == "put back", watch.record
        assert _classes(proc.pid) == start
    finally:
        watch.close()


def test_a_take_before_the_watch_found_the_process_lowers_nothing(tmp_path, child) -> None:
    watch = StartWatch(os.getpid(), str(tmp_path / "c.json"), str(tmp_path / "c.json"), bound_s=600.0)
    assert watch.put_back() == 0 and watch.finished.wait(60)
    proc = child(str(tmp_path / "c.json"))  # shows up after the take: left alone
    assert {policy for policy, _ in _classes(proc.pid)} == {0} and not watch.lowered.is_set()
