"""``workers.reuse``: a cleanly finished run's worker processes serve the driver's next run
(elastictrain/controller/warm_pool.py), and a reused process is indistinguishable from a fresh one.

One module-scoped sequence of runs in this driver (tests/conftest.py's session Ray), read by the tests below:
``A`` (another job: other seed, steps and learning rate, 2 workers), ``B`` (job Y, takes A's processes),
``F`` (job Y with a raised fault: takes B's; the raiser is never pooled, its survivor and replacement
are: tests/test_pool_faulted.py), ``G`` (job Y: fresh processes, the pool emptied after F by ``POOL.clear``)
and ``H`` (another key: ``cpus_per_worker`` 0.5; G's processes stay idle beside H's). The driver-level promises (an edited
task file, the pool emptied at ``ray.shutdown`` and at exit) run in a second driver process connected to the
session's Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from elastictrain.controller.warm_pool import POOL, PoolKey, Warm, WarmPool, current_session
from tests.conftest import _ensure_local_ray, job, run_job
from tests.procs import running, wait_gone

ROOT = Path(__file__).resolve().parent.parent
W2 = {"min": 2, "max": 2, "reuse": True}
Y = job(name="y", train={"steps": 8}, workers=W2)


def _started(run) -> list[dict]:
    return sorted(run.of("worker_started"), key=lambda e: e["rank"])


@pytest.fixture(scope="module")
def seq(tmp_path_factory):
    _ensure_local_ray()
    tmp = tmp_path_factory.mktemp("warm")
    POOL.clear()  # what earlier files left idle (the pool keeps up to a node's CPUs' worth per key)
    out = {"A": run_job(tmp, job(name="a", train={"steps": 5, "seed": 7}, workers=W2,
                                 task={"optimizer": {"lr": 1e-2, "warmup_steps": 1}}), name="A")}
    out["pool_after_A"] = sorted(POOL.pids())
    out["B"] = run_job(tmp, Y, name="B")
    boom = {"rank": 1, "step": 3, "point": "backward", "kind": "raise"}
    out["F"] = run_job(tmp, {**Y, "faults": [boom]}, name="F")
    out["pool_after_F"] = sorted(POOL.pids())
    POOL.clear()  # G: the fresh reference
    out["G"] = run_job(tmp, Y, name="G")
    out["pool_after_G"] = sorted(POOL.pids())
    out["H"] = run_job(tmp, job(name="h", train={"steps": 2}, workers={"min": 1, "max": 1, "reuse": True,
                                                                        "cpus_per_worker": 0.5}), name="H")
    out["pool_after_H"] = sorted(POOL.pids())
    return out


def test_a_reused_run_trains_bitwise_like_fresh_processes(seq) -> None:
    a, b, g = seq["A"], seq["B"], seq["G"]
    for run in (a, b, g):
        assert run.result.exit_code == 0, run.summary
    # B ran in A's processes (pooled after A's clean end), G in fresh ones
    assert seq["pool_after_A"] == sorted(e["pid"] for e in _started(a))
    assert [e["reused"] for e in _started(b)] == [True, True]
    assert sorted(e["pid"] for e in _started(b)) == seq["pool_after_A"]
    assert [e["reused"] for e in _started(g)] == [False, False]
    # A trained another job in those processes: nothing of it (model, optimizer, data, RNG) reaches B
    assert a.losses() != b.losses()
    assert b.losses() == g.losses() and len(b.losses()) == 8  # every step, bitwise
    assert b.summary["final_model_sha256"] == g.summary["final_model_sha256"]
    params_b, params_g = b.final_params(), g.final_params()
    assert params_b.keys() == params_g.keys() and all(params_b[k].equal(params_g[k]) for k in params_b)


def test_a_faulted_runs_failed_process_is_never_reused(seq) -> None:
    f, g = seq["F"], seq["G"]
    assert f.result.exit_code == 0 and f.of("failure"), f.summary  # recovered from its raised fault
    assert all(e["reused"] for e in _started(f) if e["generation"] == 0)  # F took B's processes...
    f_pids = {e["pid"] for e in f.of("worker_started")}
    hit = {e["pid"] for e in f.of("failure")}
    # ... and gave back those that trained to its end (the raiser's peer and the replacement), never the raiser
    assert hit and set(seq["pool_after_F"]) == f_pids - hit
    assert f_pids.isdisjoint(e["pid"] for e in g.of("worker_started"))  # G: fresh (the pool emptied)
    assert wait_gone(sorted(hit)) == []


def test_the_pool_keeps_other_keys_processes_beside_a_run_of_another_key(seq) -> None:
    g, h = seq["G"], seq["H"]
    g_pids = sorted(e["pid"] for e in _started(g))
    assert seq["pool_after_G"] == g_pids
    # H's cpus_per_worker differs: it took none of G's processes (started its own), and G's stay idle beside
    # H's for a later run of G's key (4 CPUs hold 8 workers of 0.5: nothing over the cap)
    assert [e["reused"] for e in _started(h)] == [False]
    assert set(e["pid"] for e in _started(h)).isdisjoint(g_pids)
    assert seq["pool_after_H"] == sorted(g_pids + [e["pid"] for e in _started(h)])


def test_a_run_with_reuse_off_neither_takes_from_the_pool_nor_empties_it(seq, tmp_path) -> None:
    held = sorted(POOL.pids())
    assert held  # H's and G's
    run = run_job(tmp_path, job(name="off", train={"steps": 2}, workers={"min": 1, "max": 1, "reuse": False}))
    assert run.result.exit_code == 0
    (started,) = _started(run)
    assert started["reused"] is False and started["pid"] not in held
    assert sorted(POOL.pids()) == held and all(running(p) for p in held)
    assert POOL.clear() == len(held)  # the explicit way to empty it
    assert wait_gone(held) == [] and POOL.pids() == []


def _w(node: str) -> Warm:
    # pid 0 and no actor: kill_warm sends no signal and Ray's kill of nothing is ignored
    return Warm(actor=None, pid=0, ip="nowhere", node_id=node, session=current_session())


def test_release_keeps_every_key_within_its_own_cap_and_the_node_total_least_recently_used_killed() -> None:
    pool = WarmPool()
    k1, k2 = (PoolKey(current_session() or "", "{}", c, "t") for c in (1.0, 0.5))
    a, b, c, d = (_w("n1") for _ in range(4))
    pool.release(k1, [a, b], {"n1": 3.0})
    pool.release(k2, [c], {"n1": 3.0})  # another key: k1's stay beside it
    assert pool.holds(k1, "n1") and pool.holds(k2, "n1") and len(pool.pids()) == 3
    assert pool.take(k2, "n2") is None and pool.take(k1, "n1") in (a, b)  # own key, own node only
    pool.release(k1, [], {"n1": 3.0})
    pool.release(k2, [d], {"n1": 1.0})  # 1 CPU: two idle in all; the least recently used (k1's) goes
    assert pool.holds(k2, "n1") and not pool.holds(k1, "n1") and len(pool.pids()) == 2
    assert pool.take(k2, "n1") is d and pool.take(k2, "n1") is c  # most recently used first
    e, f, g = (_w("n1") for _ in range(3))
    pool.release(k1, [e, f, g], {"n1": 2.0})  # a key's own cap: 2 CPUs hold two 1-CPU workers
    assert pool.take(k1, "n1") is e and pool.take(k1, "n1") is f and pool.take(k1, "n1") is None
    assert pool.clear() == 0


def test_a_run_of_another_cpus_per_worker_keeps_the_other_keys_processes_the_node_has_room_for() -> None:
    """The cap is per key: a run of 1.5-CPU workers on 4 CPUs (two fit) ending beside four idle 1-CPU
    processes keeps them all (6 of the node's total of 8). With one cap for all keys (that of the ending
    run's key: 2) it killed all four, and the next 1-CPU run of the suite started its workers again."""
    pool = WarmPool()
    one, big = (PoolKey(current_session() or "", "{}", c, "t") for c in (1.0, 1.5))
    ones = [_w("n1") for _ in range(4)]
    pool.release(one, ones, {"n1": 4.0})
    bigs = [_w("n1") for _ in range(3)]  # three given back: 4 CPUs hold two of 1.5, the third goes
    pool.release(big, bigs, {"n1": 4.0})
    assert [pool.take(big, "n1") for _ in range(3)] == [bigs[0], bigs[1], None]
    assert [pool.take(one, "n1") for _ in range(5)] == [*ones, None]
    many = [_w("n1") for _ in range(9)]  # a key of 0.5 CPU: 4 CPUs hold 8, and the node keeps 8 in all
    pool.release(PoolKey(current_session() or "", "{}", 0.5, "t"), many[:4], {"n1": 4.0})
    pool.release(one, ones, {"n1": 4.0})
    pool.release(big, bigs[:2], {"n1": 4.0})  # 2 + 4 + 4 = 10 over 8: the 0.5 key's two oldest go
    assert len(pool.pids()) == 8 and pool.holds(one, "n1") and pool.holds(big, "n1")
    assert len(pool.pids(PoolKey(current_session() or "", "{}", 0.5, "t"))) == 2
    assert pool.clear() == 8


TASK_V1 = '''
import dataclasses
import functools

from elastictrain import build_config
from elastictrain.task import builtin_task

SCALE = 1.0


def _scaled(loss_fn, model, batch, seeds):
    return SCALE * loss_fn(model, batch, seeds)


def make():
    base = builtin_task(build_config({"task": {"model": {"seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 32,
                                                          "dropout": 0.1}}}))
    return dataclasses.replace(base, loss_fn=functools.partial(_scaled, base.loss_fn))
'''

DRIVER = '''
import importlib, json, os, pathlib, sys
here = pathlib.Path(__file__).parent
import ray
from elastictrain import Trainer, build_config
from elastictrain.controller.warm_pool import POOL
ray.init(address=os.environ["ET_TEST_RAY"], log_to_driver=False)
spec = json.loads((here / "spec.json").read_text())

def run(name):
    result = Trainer(build_config(spec), run_dir=here / name, console=None).fit()
    events = [json.loads(line) for line in (here / name / "events.jsonl").read_text().splitlines()]
    return {"exit": result.exit_code, "started": [e for e in events if e["event"] == "worker_started"],
            "losses": {e["step"]: e["loss"] for e in events if e["event"] == "step"}}

out = {"v1": run("v1"), "pool_v1": POOL.pids()}
out["v1b"] = run("v1b")  # the same file: reused
(here / "mytask.py").write_text((here / "mytask.py").read_text().replace("SCALE = 1.0", "SCALE = 2.0"))
importlib.reload(sys.modules["mytask"])  # the driver runs the edited file (as a notebook's reload does)
out["v2"] = run("v2")
out["pool_v2"] = POOL.pids()
if sys.argv[1] == "shutdown":
    ray.shutdown()
print("RESULT " + json.dumps(out), flush=True)
sys.stdin.read()  # stays alive until the test has looked
'''


@pytest.mark.slow  # a second driver (its own job on the session's Ray) starting its own worker processes
@pytest.mark.parametrize("end", ["shutdown", "exit"])
def test_an_edited_task_file_is_not_served_by_an_old_process_and_the_pool_dies_with_the_driver(
        ray_local, tmp_path, end) -> None:
    (tmp_path / "mytask.py").write_text(TASK_V1)  # beside the driver script: on its workers' path (Ray's rule)
    (tmp_path / "driver.py").write_text(DRIVER)
    spec = job(name="edit", train={"steps": 3}, workers={"min": 1, "max": 1, "reuse": True},
               task={"kind": "python", "entry": "mytask:make"})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "ET_TEST_RAY": ray.get_runtime_context().gcs_address}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), end], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = next((ln for ln in proc.stdout if ln.startswith("RESULT ")), None)
        assert line is not None, f"the driver ended without a result (exit {proc.wait()})"
        out = json.loads(line[len("RESULT "):])
        v1, v1b, v2 = out["v1"], out["v1b"], out["v2"]
        assert v1["exit"] == v1b["exit"] == v2["exit"] == 0
        assert [e["reused"] for e in v1b["started"]] == [True]  # the same file: the warm process served it
        assert [e["reused"] for e in v2["started"]] == [False]  # edited: a fresh process imported it
        pool = out["pool_v2"]
        # v1's process (the old file's key) was not taken by v2: it stays idle beside v2's (killed with the driver)
        assert sorted(pool) == sorted([v2["started"][0]["pid"], v1b["started"][0]["pid"]])
        # the edited file's code ran: the first step's loss (before any update) exactly doubled
        assert v2["losses"]["1"] == 2 * v1["losses"]["1"] and v1b["losses"] == v1["losses"]
        if end == "shutdown":  # the driver lives on: ray.shutdown alone ended its pooled process
            assert wait_gone(pool) == []
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
        assert wait_gone(pool) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_reuse_of_gpu_workers_is_refused_at_the_edge() -> None:
    from elastictrain import ConfigError, build_config

    with pytest.raises(ConfigError) as info:
        build_config(job(workers={"reuse": True, "use_gpu": True}))
    text = str(info.value)
    assert "workers.reuse=true with workers.use_gpu=true" in text and "set workers.reuse to false" in text
    assert build_config(job(workers={"reuse": False, "use_gpu": True})).workers.reuse is False
    assert build_config({"name": "defaults"}).workers.reuse is False  # off for users unless asked
