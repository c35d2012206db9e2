"""``workers.standby``: the group keeps one worker process started ahead (the first with the first generation's
workers), and the next replacement runs in that process (no process start, no imports) while another standby is
started. A real WorkerGroup and a real run on the session's local Ray; the evidence is the process id, no
timing."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from conftest import BackgroundRun, job

from elastictrain.config import build_config
from elastictrain.controller.group import SlotState, WorkerGroup
from elastictrain.task_loader import task_from_config


def _ready(group: WorkerGroup, index: int, timeout: float = 180.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        group.collect_ready(timeout=1.0)
        slot = group.slots[index]
        if slot.state is SlotState.READY:
            return slot.info
        assert slot.state is SlotState.STARTING, slot.info
    raise AssertionError(f"slot {index} not ready within {timeout} s")


def _pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=180)


def _priority(actor) -> dict:
    from elastictrain.worker import import_priority

    return ray.get(actor.__ray_call__.remote(lambda _: import_priority.report()), timeout=180)


def _thread_priorities(pid: int) -> set[tuple[int, int]]:
    """(scheduling policy, nice) of every thread of ``pid``, from ``/proc/<pid>/task/*/stat`` (fields 41 and
    19; policy 5 is SCHED_IDLE, 0 SCHED_OTHER): what the kernel runs it at, not what the process says."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # fields[0] is field 3 (state)
        except FileNotFoundError:  # the thread ended
            continue
        out.add((int(fields[38]), int(fields[16])))
    return out


def _may_go_back(nice: int) -> bool:
    """Whether a process of this user may lower its nice value back to ``nice`` here (Ray's workers inherit
    the capabilities and limits of this process)."""
    import resource

    from elastictrain.worker.import_priority import can_go_back

    with open("/proc/self/status") as f:
        return can_go_back(f.read(), resource.getrlimit(resource.RLIMIT_NICE)[0], nice)


def _gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_second_replacement_runs_in_the_standby_process(ray_local) -> None:
    # standby: the default (off in BASE_JOB); reuse off (on in BASE_JOB): the promises here are about which
    # process a slot runs in
    config = build_config(job(workers={"min": 1, "max": 1, "reuse": False, "standby": True}))
    group = WorkerGroup(config, task_from_config(config))
    try:
        group.spawn(0)
        first = _ready(group, 0)
        assert group._standby is None and first["standby"] is False  # no failure yet: nothing started ahead

        group.kill(group.slots[0])
        group.spawn(0)  # the first replacement starts cold ...
        cold_info = _ready(group, 0)
        assert cold_info["standby"] is False and cold_info["prebuilt"] is False
        assert group._standby is None  # once it is up a standby is due, started when the run is back to speed
        group.start_due_standby()  # (the controller's call after the replacement's generation's first step)
        standby, watch = group._standby, group._standby_watch
        assert standby is not None
        standby_pid = _pid_of(standby)
        if _may_go_back(0):  # Ray's start of it (at the raylet's nice 0) was lowered from outside too
            assert watch is not None and watch.lowered.wait(60) and watch.record["pid"] == standby_pid
        ray.get(group._standby_probe, timeout=180)  # what spawn looks at: up, on which node, its pid
        ray.get(group._standby_setup, timeout=180)  # it built the model and data ahead, with no slot
        assert group.standby_prebuilt(0)  # a recovery takes it at detection (controller._take_prebuilt)
        # untaken, it lives at the lowest priority, every thread (worker/import_priority.py), after its set-up
        # too; only where the process may go back (CAP_SYS_NICE or RLIMIT_NICE): else at the training one
        cold, ahead = _priority(group.slots[0].actor), _priority(standby)
        # SCHED_OTHER; the main thread at the nice value Ray starts workers at, Ray's own threads at 0
        trains_at = _thread_priorities(cold_info["pid"])
        assert {policy for policy, _ in trains_at} == {0} and (0, cold["nice"]) in trains_at
        assert cold == {"lowered": False, "restored_by": None, "low_threads": 0, "nice": cold["nice"]}
        lowered = _may_go_back(cold["nice"])
        if lowered:
            assert ahead["lowered"] is True and ahead["restored_by"] is None and ahead["nice"] == cold["nice"]
            assert _thread_priorities(standby_pid) == {(5, 19)}  # SCHED_IDLE at nice 19
        else:
            assert ahead == {"lowered": False, "restored_by": None, "low_threads": 0, "nice": cold["nice"]}
            assert _thread_priorities(standby_pid) == trains_at

        group.kill(group.slots[0])
        group.spawn(0)
        info = _ready(group, 0)
        assert info["standby"] is True and info["pid"] == standby_pid and info["slot"] == 0
        assert info["prebuilt"] is True  # taking it only named the slot: no build after the death
        # taken, it trains at the priority the cold worker trained at, every thread of it
        assert _thread_priorities(standby_pid) == trains_at
        taken = _priority(group.slots[0].actor)
        assert taken == {"lowered": lowered, "restored_by": "take" if lowered else None, "low_threads": 0,
                         "nice": cold["nice"]}
        group.start_due_standby()
        assert group._standby is not None and group._standby is not standby  # the next one is on its way
        next_pid = _pid_of(group._standby)
        assert next_pid != standby_pid
    finally:
        group.shutdown()
    assert _gone(next_pid), "shutdown left the standby process running"


def test_no_standby_when_turned_off(ray_local) -> None:
    config = build_config(job(workers={"min": 1, "max": 1, "reuse": False, "standby": False}))
    group = WorkerGroup(config, task_from_config(config))
    try:
        group._start_standby(0)  # what a replacement's set-up calls
        assert group._standby is None
    finally:
        group.shutdown()


def _wait_standby_started(bg: BackgroundRun, timeout: float = 120.0):
    """The controller's standby actor, once it was started (by the controller, with the first workers)."""
    deadline = time.time() + timeout
    while time.time() < deadline and bg.thread.is_alive():
        controller = getattr(bg.trainer, "controller", None)
        standby = controller.group._standby if controller is not None else None
        if standby is not None:
            return standby
        bg.thread.join(0.05)
    raise AssertionError("no standby was started while the first generation trained")


def test_first_replacement_of_a_run_runs_in_the_standby_started_ahead(tmp_path, ray_local) -> None:
    """A run that has lost no worker yet keeps a standby from its start, so its FIRST replacement
    (rank 1 SIGKILLed from outside, strict mode: the replacement must join) runs in that process."""
    # 0.1 s more per step on both ranks, every generation: the run outlasts the test's few calls below
    slow = [{"rank": r, "step": 1, "kind": "slow", "seconds": 0.1, "generation": None} for r in (0, 1)]
    spec = job(train={"steps": 40}, workers={"min": 2, "max": 2, "reuse": False, "standby": True}, recovery={"mode": "strict"},
               faults=slow)
    bg = BackgroundRun(tmp_path, spec)
    standby = _wait_standby_started(bg)  # maybe still importing: a replacement takes it all the same
    started = bg.wait_for(lambda e: e["event"] == "worker_started" and e["rank"] == 1)
    assert started["standby"] is False  # the first generation's workers start as their own processes
    os.kill(started["pid"], signal.SIGKILL)
    standby_pid = _pid_of(standby)  # threaded actor: answers beside its set-up, before the run can end
    # started with the run, it imports at the workers' priority (done in seconds, not smeared over the run)
    first = _priority(standby)
    assert first["lowered"] is False and first["low_threads"] == 0, first
    run = bg.finish(timeout=300)
    assert run.result.exit_code == 0, run.summary.get("error")
    assert run.summary["failures"] == 1 and run.summary["final_step"] == 40
    slot = started["slot"]
    again = [e for e in run.of("worker_started") if e["slot"] == slot][1:]
    assert len(again) == 1, run.of("worker_started")
    assert again[0]["standby"] is True and again[0]["pid"] == standby_pid, again[0]


def test_a_standby_is_low_until_taken_and_only_where_it_may_go_back() -> None:
    """The rule of the phase: ahead of the take SCHED_IDLE at nice 19, taken the training priority; and the
    low one only where the process may go back (else a worker left low would lose its core for good)."""
    from elastictrain.worker.import_priority import IDLE, OTHER, Phase, Priority, priority_for

    assert priority_for(Phase.AHEAD, 15, True, True) == Priority(IDLE, 19)
    for nice in (0, 15):  # the run's first standby, started with the first workers: at their priority
        assert priority_for(Phase.START, nice, True, True) == Priority(OTHER, nice)
    assert priority_for(Phase.AHEAD, 0, True, True) == Priority(IDLE, 19)
    assert priority_for(Phase.AHEAD, 0, True, False) == Priority(OTHER, 19)  # no SCHED_IDLE: nice 19 alone
    assert priority_for(Phase.AHEAD, 15, False, True) == Priority(OTHER, 15)  # may not go back: as trained
    assert priority_for(Phase.AHEAD, 19, True, False) == Priority(OTHER, 19)
    for nice in (0, 15):
        for may, idle in ((True, True), (True, False), (False, True)):
            assert priority_for(Phase.TAKEN, nice, may, idle) == Priority(OTHER, nice)


def test_a_standby_imports_at_low_priority_only_where_it_may_go_back() -> None:
    """Lowering a nice value needs CAP_SYS_NICE or RLIMIT_NICE >= 20 - nice (setpriority(2)); without either
    the standby imports at normal priority, since a worker left at nice 19 would lose its core."""
    from elastictrain.worker.import_priority import can_go_back

    no_caps, sys_nice = "Name:\tpython\nCapEff:\t0000000000000000\n", "CapEff:\t0000000000800000\n"
    assert not can_go_back(no_caps, 0, 0) and not can_go_back(no_caps, 19, 0)
    assert not can_go_back(no_caps, 4, 15) and can_go_back(no_caps, 5, 15)  # Ray's workers: nice 15
    assert can_go_back(sys_nice, 0, 0) and can_go_back(no_caps, 20, 0) and can_go_back(no_caps, -1, 0)
    assert not can_go_back("CapEff:\tzz\n", 0, 0)


def test_a_standby_process_lowers_itself_before_torch_is_imported_and_goes_back() -> None:
    """In a process started as a standby (the group's environment variable), importing the worker package
    (what Ray's preload of the actor module does first) puts every thread, one started before included, in
    SCHED_IDLE at nice 19 before torch is imported; ``restore`` (the take) puts them all back and clears the
    variable for the process's children."""
    import subprocess
    import sys

    from elastictrain.worker.import_priority import STANDBY_ENV

    code = """
import os, sys, threading
start = os.getpriority(os.PRIO_PROCESS, 0)
done = threading.Event()
other = threading.Thread(target=done.wait, daemon=True)  # a thread started before (Ray's, in a worker)
other.start()
def prio():
    return sorted({(os.sched_getscheduler(int(t)), os.getpriority(os.PRIO_PROCESS, int(t)))
                   for t in os.listdir("/proc/self/task")})
import elastictrain.worker
from elastictrain.worker import import_priority as ip
print(prio() == [(os.SCHED_IDLE, 19)], "torch" in sys.modules, ip.report()["lowered"])
ip.restore()
print(prio() == [(os.SCHED_OTHER, start)], ip.report()["low_threads"], os.environ.get(ip.STANDBY_ENV))
"""
    if not _may_go_back(os.nice(0)):
        pytest.skip("this user may not lower a nice value here (no CAP_SYS_NICE, RLIMIT_NICE too low): the standby "
                    "imports at normal priority, as test_a_standby_imports_at_low_priority_only_where_it_may_go_back "
                    "decides")
    env = {**os.environ, STANDBY_ENV: "ahead", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["True False True", "True 0 None"], out.stdout


_LOWERING_CHILD = """
import os, sys, threading
done = threading.Event()
threading.Thread(target=done.wait, daemon=True).start()  # a thread started before (Ray's, in a worker)
import elastictrain.worker
from elastictrain.worker import import_priority as ip
print(ip.report()["lowered"], flush=True)
sys.stdin.readline()  # the test reads /proc meanwhile
"""


def _standby_child(path: str):
    import subprocess
    import sys

    from elastictrain.worker.import_priority import PRIORITIES_ENV, STANDBY_ENV

    env = {**os.environ, STANDBY_ENV: "ahead", PRIORITIES_ENV: path, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", _LOWERING_CHILD], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_the_group_puts_a_standby_back_from_outside_or_marks_it_before_it_lowers(tmp_path) -> None:
    """The take from the group's side (``put_back``, no call into the standby, so no GIL of its): a standby
    that lowered itself has every thread put back at the nice value it had, by pid, from the file it wrote
    before lowering; one taken before it got that far finds the group's mark and never lowers itself."""
    from elastictrain.worker.import_priority import put_back

    if not _may_go_back(os.nice(0)):
        pytest.skip("this user may not lower a nice value here: a standby is never lowered")
    start = os.nice(0)
    lowered = _standby_child(str(tmp_path / "a.json"))
    try:
        assert lowered.stdout.readline().strip() == "True"
        assert _thread_priorities(lowered.pid) == {(5, 19)}
        assert put_back(str(tmp_path / "a.json")).startswith("restored ")
        assert _thread_priorities(lowered.pid) == {(0, start)}
    finally:
        lowered.communicate("\n", timeout=60)

    assert put_back(str(tmp_path / "b.json")) == "marked"  # taken before its process got to lower itself
    late = _standby_child(str(tmp_path / "b.json"))
    try:
        assert late.stdout.readline().strip() == "False"
        assert _thread_priorities(late.pid) == {(0, start)}
    finally:
        late.communicate("\n", timeout=60)
    assert put_back(str(tmp_path / "c.json")) == "marked" and put_back(str(tmp_path / "c.json")) == "not here"


def test_sweep_removes_the_files_no_standby_needs(tmp_path) -> None:
    """A standby killed before its group's shutdown may write its file after the group looked: the next
    standby's start sweeps files of dead processes and old marks, and keeps a live one's and a fresh mark."""
    import json
    import subprocess
    import sys
    import time

    from elastictrain.worker.import_priority import MARK_TTL_S, put_back, sweep

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    files = {"dead": int(dead.stdout), "live": os.getpid()}
    for name, pid in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"pid": pid, "nice": 0, "threads": {}}))
    assert put_back(str(tmp_path / "old_mark.json")) == "marked"
    assert put_back(str(tmp_path / "new_mark.json")) == "marked"
    os.utime(tmp_path / "old_mark.json", (time.time() - MARK_TTL_S - 60,) * 2)
    assert sweep(str(tmp_path), time.time()) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.json", "new_mark.json"]
