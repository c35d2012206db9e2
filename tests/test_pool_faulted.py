"""``workers.reuse`` after faults: the processes of a faulted run that ended ``finished`` serve the driver's next
runs, except the process a fault hit (elastictrain/controller/warm_pool.py), and a new worker of a run
(a replacement) takes a pooled process instead of starting one.

One module-scoped sequence of runs in this driver (tests/conftest.py's session Ray), read by the tests below.
Every run has ``min`` = ``max`` workers (a failure waits for its replacement, so every fault fires in the
generation it names):

- ``K`` (3 workers, 12 samples a step): rank 1 killed in step 3 (generation 0), then its replacement raises in step 6's
  backward (generation 1): two survivors (ranks 0 and 2), the killed process, the raiser, and the second
  replacement, which trains to the end.
- ``C`` (2 workers, job ``Y`` without faults): takes two of ``K``'s three; the third stays idle in the pool.
- ``L1`` (``Y``): rank 1 killed in step 3; its two processes come from the pool's three, and the
  replacement takes the third, idle beside it.
- ``L2`` (``Y``): the same; the pool holds no idle process now, so the replacement is a fresh one.
- ``B`` (``Y`` without faults) on what survived: rank 0 of ``K`` has survived three faulted runs.
- ``G`` (``Y``) on fresh processes (the pool emptied first): the reference ``B`` must equal bitwise, and
  after its clean end the thread and open-file counts of a fresh process that ran one run.
- ``X`` (``Y``, no failure allowed): rank 0 killed, the run fails, and its survivor is not pooled.
"""

from __future__ import annotations

import os

import pytest

from elastictrain.controller.warm_pool import POOL
from tests.conftest import _ensure_local_ray, job, run_job
from tests.procs import wait_gone

W2 = {"min": 2, "max": 2, "reuse": True}
W3 = {"min": 3, "max": 3, "reuse": True}
Y = job(name="y", train={"steps": 8}, workers=W2)
KILL3 = {"rank": 1, "step": 3, "point": "mid_step", "kind": "kill", "generation": 0}
RAISE6 = {"rank": 1, "step": 6, "point": "backward", "kind": "raise", "generation": 1}


def _resources(pid: int) -> tuple[int, int]:
    """(threads, open file descriptors) of a pooled (idle) process on this node."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def _pool() -> dict[int, tuple[int, int]]:
    return {pid: _resources(pid) for pid in sorted(POOL.pids())}


@pytest.fixture(scope="module")
def seq(tmp_path_factory):
    _ensure_local_ray()
    tmp = tmp_path_factory.mktemp("pool_faulted")
    POOL.clear()  # earlier files' processes: this sequence counts its own
    k = job(name="k", train={"steps": 8, "global_batch": 12, "micro_batch": 2}, workers=W3, faults=[KILL3, RAISE6])
    out = {"K": run_job(tmp, k, name="K"), "pool": {}}
    out["pool"]["K"] = _pool()
    out["C"] = run_job(tmp, Y, name="C")
    out["pool"]["C"] = _pool()
    for name in ("L1", "L2"):
        out[name] = run_job(tmp, {**Y, "faults": [KILL3]}, name=name)
        out["pool"][name] = _pool()
    out["B"] = run_job(tmp, Y, name="B")
    out["pool"]["B"] = _pool()
    POOL.clear()
    out["G"] = run_job(tmp, Y, name="G")
    out["pool"]["G"] = _pool()
    out["X"] = run_job(tmp, job(name="x", train={"steps": 6}, workers=W2, recovery={"max_failures": 0},
                                faults=[{"rank": 0, "step": 2, "point": "mid_step", "kind": "kill"}]), name="X")
    out["pool"]["X"] = sorted(POOL.pids())
    return out


def _failed_pids(run) -> list[int]:
    return [e["pid"] for e in run.of("failure")]


def _started(run, generation: int) -> list[dict]:
    return sorted((e for e in run.of("worker_started") if e["generation"] == generation), key=lambda e: e["rank"])


def _survivor(seq) -> int:
    """Rank 0 of ``K``'s first generation: trained through every faulted run of the sequence."""
    return _started(seq["K"], 0)[0]["pid"]


@pytest.mark.slow  # the module\'s sequence: seven runs on the session\'s Ray (~1-2 min on 2 cores)
def test_a_faulted_run_pools_its_survivors_and_replacement_never_the_process_a_fault_hit(seq) -> None:
    k = seq["K"]
    assert k.result.exit_code == 0, k.summary
    assert sorted(e["kind"] for e in k.of("failure")) == ["exception", "process_died"], k.of("failure")
    started = k.of("worker_started")
    assert len(started) == 5, started  # the first three, then one replacement per failure
    hit = _failed_pids(k)
    live = sorted(e["pid"] for e in started if e["pid"] not in hit)
    assert len(hit) == 2 and len(live) == 3
    # both survivors (trained through both failures) and the last replacement are pooled
    assert sorted(seq["pool"]["K"]) == live and _survivor(seq) in live
    assert wait_gone(hit) == []  # the killed process and the raiser: killed by the run, never pooled


@pytest.mark.slow  # the module\'s sequence: seven runs on the session\'s Ray (~1-2 min on 2 cores)
def test_the_pool_keeps_what_a_smaller_run_left_idle(seq) -> None:
    c = seq["C"]
    assert c.result.exit_code == 0, c.summary
    taken = [e["pid"] for e in c.of("worker_started")]
    assert [e["reused"] for e in c.of("worker_started")] == [True, True]
    (idle,) = set(seq["pool"]["K"]) - set(taken)
    assert set(seq["pool"]["C"]) == set(taken) | {idle}  # within its key's cap (4 of 1 CPU on the session's Ray)


@pytest.mark.slow  # the module\'s sequence: seven runs on the session\'s Ray (~1-2 min on 2 cores)
def test_a_replacement_takes_an_idle_pooled_process_and_a_fresh_one_when_none_is_idle(seq) -> None:
    l1, l2 = seq["L1"], seq["L2"]
    for run in (l1, l2):
        assert run.result.exit_code == 0, run.summary
        assert [e["kind"] for e in run.of("failure")] == ["process_died"]
        assert [e["reused"] for e in _started(run, 0)] == [True, True]  # from the previous run's pool
        assert _survivor(seq) in seq["pool"][run.dir.name]
    # L1: the pool held three processes; L1's first generation took two and its replacement the third
    assert {e["pid"] for e in l1.of("worker_started")} == set(seq["pool"]["C"])
    assert [e["reused"] for e in l1.of("worker_started") if e["generation"] > 0] == [True]
    # L2: L1 left two, both taken at the start: the replacement is fresh, and pooled after the clean end
    (fresh,) = [e for e in l2.of("worker_started") if e["generation"] > 0]
    assert fresh["reused"] is False and fresh["pid"] in seq["pool"]["L2"]
    assert len(seq["pool"]["L1"]) == len(seq["pool"]["L2"]) == 2


@pytest.mark.slow  # the module\'s sequence: seven runs on the session\'s Ray (~1-2 min on 2 cores)
def test_a_run_on_survivors_of_faulted_runs_trains_bitwise_like_fresh_processes(seq) -> None:
    b, g = seq["B"], seq["G"]
    for run in (b, g):
        assert run.result.exit_code == 0, run.summary
    assert [e["reused"] for e in b.of("worker_started")] == [True, True]
    assert sorted(e["pid"] for e in b.of("worker_started")) == sorted(seq["pool"]["L2"])
    assert _survivor(seq) in seq["pool"]["L2"]
    assert [e["reused"] for e in g.of("worker_started")] == [False, False]
    assert b.losses() == g.losses() and len(b.losses()) == 8  # every step, bitwise
    assert b.summary["final_model_sha256"] == g.summary["final_model_sha256"]
    params_b, params_g = b.final_params(), g.final_params()
    assert params_b.keys() == params_g.keys() and all(params_b[k].equal(params_g[k]) for k in params_b)


@pytest.mark.slow  # the module\'s sequence: seven runs on the session\'s Ray (~1-2 min on 2 cores)
def test_a_survivors_threads_and_open_files_do_not_grow_run_after_run(seq) -> None:
    survivor = _survivor(seq)
    counts = [seq["pool"][name][survivor] for name in ("K", "C", "L1", "L2", "B")]
    fresh = seq["pool"]["G"]  # fresh processes retired after one clean run
    assert len(fresh) == 2
    # the same process after a faulted run, a clean one, two faulted ones and a clean one: no thread or
    # descriptor kept from an aborted generation (each holds a gloo group's threads and sockets: a leaked
    # one adds several of each per run), and no more than a fresh process holds. A margin of 2 threads and
    # 4 descriptors over the whole sequence: Ray may open a connection or a thread late, once
    threads, fds = [t for t, _ in counts], [f for _, f in counts]
    assert max(threads) - threads[0] <= 2 and max(fds) - fds[0] <= 4, counts
    assert max(threads) <= max(t for t, _ in fresh.values()) + 2, (counts, fresh)
    assert max(fds) <= max(f for _, f in fresh.values()) + 4, (counts, fresh)


@pytest.mark.slow  # the module\'s sequence: seven runs on the session\'s Ray (~1-2 min on 2 cores)
def test_a_run_that_did_not_finish_pools_nothing(seq) -> None:
    x = seq["X"]
    assert x.result.exit_code != 0, x.summary
    assert [e["reused"] for e in x.of("worker_started")] == [True, True]  # G's processes
    assert seq["pool"]["X"] == []
    survivors = [e["pid"] for e in x.of("worker_started") if e["pid"] not in _failed_pids(x)]
    assert survivors and wait_gone(survivors) == []


def test_a_fault_that_fires_marks_its_process_and_slow_or_nan_do_not() -> None:
    """The worker's half of the rule (``Worker.retire`` refuses a process a fault fired in), without Ray."""
    from elastictrain.config import FaultConfig
    from elastictrain.worker.faults import FaultInjector, InjectedFault

    faults = [FaultConfig(rank=1, step=3, point="before_step", kind="raise"),
              FaultConfig(rank=0, step=1, point="before_step", kind="slow", seconds=0.0),
              FaultConfig(rank=0, step=2, point="before_step", kind="nan")]
    bystander, slowed, raiser = FaultInjector(faults), FaultInjector(faults), FaultInjector(faults)
    bystander.fire(rank=0, step=3, point="before_step", generation=0)  # another rank's fault: not this one
    slowed.fire(rank=0, step=1, point="before_step", generation=0)  # a slow fault's own point: no act
    slowed.extra_delay(rank=0, step=4, generation=0)
    assert slowed.nan_at(rank=0, step=2, generation=0)
    with pytest.raises(InjectedFault):
        raiser.fire(rank=1, step=3, point="before_step", generation=0)
    assert (bystander.touched, slowed.touched, raiser.touched) == (False, False, True)
