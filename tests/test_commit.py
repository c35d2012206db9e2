"""A step commits only when its collectives are known to have completed on its generation's group; a
non-finite step is skipped on every rank alike; a stall nobody is blamed for regroups; every step reports
its ranks' peak memory (issue 36, items 5 and 1). Real runs: 2 gloo workers on the session's local Ray."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from elastictrain import build_config
from elastictrain.task import builtin_task
from tests.commit_fixtures import ALLOC_STEP as _ALLOC_STEP, FINISH_MIB, AllocatingLoss, AllocatingStateDict
from tests.conftest import job, run_job

STEPS = 8
SPEC = job(train={"steps": STEPS})


def _index(run: Any, pred: Any) -> int:
    return next(i for i, e in enumerate(run.events) if pred(e))


def test_an_abort_between_the_word_and_the_optimizer_discards_the_step(tmp_path, ray_local, clean_run) -> None:
    """Rank 1 dies after step 4's word reduced and before its optimizer; the controller's abort reaches rank 0
    at the same point (fault ``abort`` at point ``commit``: what ``abort_group`` does there). Rank 0 must not
    commit step 4 from a reduction the abort may have cut short: no step 4 of the first generation is
    reported, the survivor hands over step 3, and the run's every loss equals an uninterrupted run's."""
    faults = [{"rank": 1, "step": 4, "point": "commit", "kind": "kill"},
              {"rank": 0, "step": 4, "point": "commit", "kind": "abort"}]
    # strict: the replacement rejoins before step 4, so the math (and the final model) is bitwise the clean run's
    run = run_job(tmp_path, job(train={"steps": STEPS}, faults=faults, recovery={"mode": "strict"}))
    clean = clean_run(SPEC)
    assert run.result.exit_code == 0, run.summary["error"]
    (failure,) = run.of("failure")
    assert failure["rank"] == 1 and failure["kind"] == "process_died"
    # step 4 is reported once, by the generation after the failure: the aborted step never committed
    fours = [i for i, e in enumerate(run.events) if e["event"] == "step" and e["step"] == 4]
    assert len(fours) == 1 and fours[0] > _index(run, lambda e: e["event"] == "failure")
    (recovered,) = run.of("recovered")
    assert recovered["step"] == 3, recovered
    assert run.losses() == clean.losses()
    assert run.summary["final_model_sha256"] == clean.summary["final_model_sha256"]


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory, clean_run):
    """The same run with rank 1's (then rank 0's) loss and gradients NaN at step 3."""
    from tests.conftest import _ensure_local_ray

    _ensure_local_ray()
    out = {}
    for rank in (1, 0):
        faults = [{"rank": rank, "step": 3, "kind": "nan"}]
        out[rank] = run_job(tmp_path_factory.mktemp("nan"), job(train={"steps": STEPS}, faults=faults))
    out["clean"] = clean_run(SPEC)
    return out


def test_a_nan_step_is_skipped_on_every_rank_alike(nan_runs) -> None:
    """A NaN on one rank at step 3: the reduced loss is NaN on every rank, so every rank skips the update
    (one ``step_skipped`` naming that rank); the steps before are the clean run's, the steps after are
    finite (a replica that applied the NaN gradients would make every later loss NaN), and the run is the
    same whichever rank produced the NaN (the decision is the group's, not the rank's)."""
    one, zero, clean = nan_runs[1], nan_runs[0], nan_runs["clean"]
    for rank, run in ((1, one), (0, zero)):
        assert run.result.exit_code == 0, run.summary["error"]
        (skipped,) = run.of("step_skipped")
        assert skipped["step"] == 3 and f"rank {rank}" in skipped["reason"] and "non-finite loss" in skipped["reason"]
        losses = run.losses()
        assert losses[3] is None and [e["skipped"] for e in run.of("step") if e["step"] == 3] == [True]
        assert {s: losses[s] for s in (1, 2)} == {s: clean.losses()[s] for s in (1, 2)}
        assert all(math.isfinite(losses[s]) for s in range(4, STEPS + 1))
        assert losses[STEPS] != clean.losses()[STEPS]  # step 3's update is missing
    assert one.losses() == zero.losses()
    assert one.summary["final_model_sha256"] == zero.summary["final_model_sha256"]


def test_nonfinite_steps_in_a_row_fail_the_run_naming_step_and_rank(tmp_path, ray_local) -> None:
    """NaN at steps 3, 4 and 5 on rank 1, ``recovery.max_nonfinite_steps: 3``: the run fails (exit 1) and
    says which step and which rank."""
    faults = [{"rank": 1, "step": s, "kind": "nan"} for s in (3, 4, 5)]
    run = run_job(tmp_path, job(train={"steps": STEPS}, faults=faults, recovery={"max_nonfinite_steps": 3}))
    assert run.result.exit_code == 1
    (failed,) = run.of("run_failed")
    assert "step 5" in failed["reason"] and "rank 1" in failed["reason"], failed
    assert "recovery.max_nonfinite_steps" in failed["reason"]
    assert [e["in_a_row"] for e in run.of("step_skipped")] == [1, 2, 3]


@pytest.mark.slow
def test_a_stall_that_blames_nobody_regroups_and_finishes_clean(tmp_path, ray_local, clean_run) -> None:
    """Both ranks wait in a "collective" at step 4 that never completes (fault ``stall``: what NCCL ranks in
    a device sync do when a peer's kernel hangs): every member answers and none computes, so the hang rule
    blames nobody. After ``policy.STALL_FALLBACK_FACTOR`` hang bounds the controller aborts every member;
    the group regroups from step 3 and the run finishes with the uninterrupted run's losses."""
    faults = [{"rank": r, "step": 4, "point": "commit", "kind": "stall"} for r in (0, 1)]
    run = run_job(tmp_path, job(train={"steps": STEPS}, faults=faults))
    clean = clean_run(SPEC)
    assert run.result.exit_code == 0, run.summary["error"]
    (stall,) = run.of("stall_aborted")
    assert stall["members"] == 2 and "no member to blame" in stall["reason"]
    assert [e["kind"] for e in run.of("failure")] == ["group_failed"]
    assert run.losses() == clean.losses()
    assert run.summary["final_model_sha256"] == clean.summary["final_model_sha256"]


# ---------------------------------------------------------------- memory (item 1)


def test_every_step_reports_peak_memory_and_the_run_reports_each_ranks_to_its_end(tmp_path, ray_local) -> None:
    """Each ``step`` event carries the highest host peak any rank reported since the previous one (with the
    rank); ``summary.json`` every rank's. 200 MiB held for a moment in step 4 on rank 0 show in step 4's
    figure, not in step 6's (the mark is reset after each step). What a rank holds after its last step
    (the digest, the final model's write) is in ``summary.json``'s per-rank peaks too: 600 MiB every rank
    holds for a moment while its final model's state is read show there, above every step's figure (the
    first one's holds the set-up) and well above the last step's (the share rule runs to the end)."""
    # fresh processes (workers.reuse, on in BASE_JOB, off): the first figure is a fresh process's set-up, and a
    # reused one's heap keeps what an earlier run freed, which moves every figure
    spec = job(train={"steps": STEPS}, workers={"min": 2, "max": 2, "reuse": False})
    task = builtin_task(build_config(spec))
    task = dataclasses.replace(task, loss_fn=AllocatingLoss(task.loss_fn),
                               model_fn=AllocatingStateDict(task.model_fn))
    run = run_job(tmp_path, spec, task=task)
    assert run.result.exit_code == 0, run.summary["error"]
    steps = {e["step"]: e for e in run.of("step")}
    assert all(e["memory"]["host_mib"] > 50 for e in steps.values())
    assert steps[_ALLOC_STEP]["memory"]["host_rank"] == 0
    assert steps[_ALLOC_STEP]["memory"]["host_mib"] >= steps[_ALLOC_STEP + 2]["memory"]["host_mib"] + 150
    memory = run.summary["memory"]
    by_rank = {int(r): p["host_mib"] for r, p in memory["by_rank"].items()}
    assert set(by_rank) == {0, 1} and memory["host_mib"] == max(by_rank.values())
    assert by_rank[memory["host_rank"]] == memory["host_mib"]
    figures = [steps[s]["memory"]["host_mib"] for s in sorted(steps)]
    assert all(peak >= max(max(figures) + 100, figures[-1] + FINISH_MIB / 2) for peak in by_rank.values()), \
        (by_rank, figures)


def test_the_step_events_memory_is_the_highest_peak_since_the_previous_one(tmp_path) -> None:
    """Pure ledger check (no run): a step event carries the highest peak any rank reported since the previous
    step event and that rank, whatever reported it (the reporting rank's record, another rank's poll); the
    summary keeps every rank's run peak. One entry per kind in the event, whatever the world size."""
    from elastictrain.controller.ledger import Ledger
    from elastictrain.events import EventLog
    from elastictrain.worker.loop import StepRecord

    ledger = Ledger(EventLog(tmp_path, console=None), total_steps=3, global_batch=4, max_workers=1000)
    ledger.new_generation(0, 1000, 1)

    def record(step: int, host: float) -> StepRecord:
        return StepRecord(step=step, loss=1.0, world_size=1000, accum=1, step_s=0.1, compute_s=0.1,
                          finished_at=float(step), memory={"host_mib": host})

    ledger.note_memory(731, {"host_mib": 900.0})  # another rank's poll, before step 1's record
    (one,) = ledger.add(0, record(1, 500.0), complete=True)
    (two,) = ledger.add(0, record(2, 510.0), complete=True)
    assert one["memory"] == {"host_mib": 900.0, "host_rank": 731}
    assert two["memory"] == {"host_mib": 510.0, "host_rank": 0}  # the window started afresh
    summary = ledger.summary("finished", {})["memory"]
    assert summary["host_mib"] == 900.0 and summary["host_rank"] == 731
    assert summary["by_rank"] == {"0": {"host_mib": 510.0}, "731": {"host_mib": 900.0}}
