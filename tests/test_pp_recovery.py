"""Pipeline parallel recovers like every other layout (real Ray, real gloo, real SIGKILL / SIGTERM): a dead
stage rank's state comes from a replica of its stage (pp2 x dp2), else the peer memory tier (pp2 alone),
else storage; the world shrinks to whole pipelines and grows back; a pp2 checkpoint resumes under ddp.
Each run ends with the loss of an uninterrupted one and every step saw exactly its samples."""

from __future__ import annotations

import copy
import json

import pytest

from tests.audit import assert_cursor_audit
from tests.conftest import BASE_JOB, job, run_job
from tests.grow_gate import assert_held_one_step, hold_until_grown
from tests.parallel_fixtures import (RECOVERY_PARAM_ATOL, InProcessRun, assert_grew_back_from_the_last_step,
                                     assert_same_numbers)

STEPS = 16
# two blocks: one per stage of pp2 (the built-in GPT needs n_layer >= pp)
MODEL = {**BASE_JOB["task"]["model"], "n_layer": 2}
TASK = {**copy.deepcopy(BASE_JOB["task"]), "model": MODEL}
TRAIN = {"steps": STEPS, "global_batch": 16, "micro_batch": 2}
# the uninterrupted reference: one process (the worker's step loop in the test's own process), the same math
# (pipelined layouts differ by fp32 sum order only)
CLEAN = job(task=TASK, train=TRAIN, workers={"min": 1, "max": 1})
# timeouts for a loaded 2-core machine: a survivor leaving a failed step can take longer than 15 s to be
# scheduled there (seen: two tp2 x dp2 survivors "did not leave the failed step within 15s", the run then
# restarted from scratch); the order collective < watchdog cap < poll < restart grace is kept
TIMEOUTS = {**job()["timeouts"], "collective_s": 60, "step_watchdog_cap_s": 70, "poll_s": 80,
            "watchdog_floor_s": 10, "restart_grace_s": 240}


def _slow(world: int, seconds: float = 0.03, generation: int | None = None) -> list[dict]:
    return [{"rank": r, "step": 1, "kind": "slow", "seconds": seconds, "generation": generation}
            for r in range(world)]


def _spec(world: int, min_workers: int, faults: list[dict], **sections) -> dict:
    """A pp2 job on ``world`` workers (a copy the test may change: TASK and MODEL are shared)."""
    spec = job(task=TASK, train={**TRAIN, "audit_samples": True}, workers={"min": min_workers, "max": world},
               parallel={"plan": "ddp", "pp": 2}, faults=_slow(world) + faults,
               recovery={"min_workers_wait_s": 240}, timeouts=dict(TIMEOUTS), **sections)
    return copy.deepcopy(spec)


def _audit(run, steps: int = STEPS) -> None:
    """Every step 1..steps ran and saw exactly its global-cursor samples (tests/audit.py)."""
    assert_cursor_audit(run, steps, MODEL["seq_len"], TRAIN["global_batch"])


_CLEAN: dict[str, InProcessRun] = {}


def _clean(spec: dict) -> InProcessRun:
    """``spec`` (a one-worker job) uninterrupted, trained once per spec in this process."""
    key = json.dumps(spec, sort_keys=True)
    if key not in _CLEAN:
        _CLEAN[key] = InProcessRun(spec)
    return _CLEAN[key]


def _like_clean(run, clean: dict, **tolerance: float) -> None:
    """Finished, every step (``clean``'s number of them) saw its samples, and every step's loss (a redone
    one too) and the final parameters are those of the uninterrupted run (within fp32 sum order:
    tests/parallel_fixtures.py)."""
    steps = clean["train"]["steps"]
    assert run.result.exit_code == 0 and run.summary["final_step"] == steps, run.summary
    _audit(run, steps)
    assert_same_numbers(run, _clean(clean), **{"param_atol": RECOVERY_PARAM_ATOL, **tolerance})


def _kept_their_process(run, slots) -> None:
    for slot in slots:
        assert len({e["pid"] for e in run.of("worker_started") if e["slot"] == slot}) == 1, slot


def test_pp2_dp2_stage_rank_killed_recovers_from_its_stage_replica_shrinks_and_grows(tmp_path, ray_local):
    """pp2 x dp2 on 4 (stage 0 = ranks 0,1; stage 1 = ranks 2,3): rank 1 is SIGKILLed mid-step. Rank 0
    holds stage 0 and ranks 2,3 stage 1: the survivors serve their snapshots (no keeper, no storage), the
    3 left fold to one whole pipeline (pp2 x dp1) and grow back to 4 once the replacement is up (the folded
    generation is held before its first step until then: tests/grow_gate.py). Every survivor keeps its
    process."""
    kill = {"rank": 1, "step": 6, "point": "mid_step", "kind": "kill"}
    run = run_job(tmp_path, _spec(4, 2, [kill, *hold_until_grown(2)]), name="pp2dp2")
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 1)], run.of("failure")
    rec = run.of("recovered")[0]
    assert rec["source"] == "peer" and rec["lost_steps"] <= 1, rec
    assert "survivors [0, 2] hold every stage's every shard" in rec["reason"], rec
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in run.of("resized")]
    assert sizes[:2] == [(4, 2), (2, 4)], sizes  # whole pipelines only: 3 workers run one pipeline
    assert_grew_back_from_the_last_step(run)
    assert_held_one_step(run)
    _kept_their_process(run, [0, 2, 3])
    _like_clean(run, CLEAN)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pp2_stage_rank_killed_recovers_from_the_peer_memory_tier(tmp_path, ray_local, schedule):
    """pp2 alone on 2: stage 1's only rank is SIGKILLed mid-step; no survivor holds stage 1, the peer tier
    (a snapshot every step) does. The replacement loads its stages from the keeper, rank 0 its own. Under
    zbv each rank holds two stages of a V (rank 0: the first and the last of 4 blocks), loaded by name."""
    kill = {"rank": 1, "step": 6, "point": "mid_step", "kind": "kill"}
    spec = _spec(2, 2, [kill], checkpoint={"memory_every_steps": 1})
    clean = CLEAN
    if schedule != "1f1b":
        spec["parallel"]["pp_schedule"] = schedule
        spec["task"]["model"]["n_layer"] = 4
        clean = copy.deepcopy(CLEAN)
        clean["task"]["model"]["n_layer"] = 4
    run = run_job(tmp_path, spec, name="pp2mem")
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 1)], run.of("failure")
    rec = run.of("recovered")[0]
    assert rec["source"] == "memory" and rec["lost_steps"] <= 1, rec
    assert "lack (pipeline stage, shard coordinate) [(1, 0)]" in rec["reason"], rec
    _kept_their_process(run, [0])
    _like_clean(run, clean)


def test_pp2_fsdp2_lost_shard_of_a_stage_comes_from_the_tier_resharded_to_one_pipeline(tmp_path, ray_local):
    """pp2 x fsdp2 on 4: rank 3 holds half of stage 1 and is SIGKILLed. Ranks 0,1 cover stage 0 and rank 2
    only half of stage 1, so no survivor set is a state: the tier's snapshots of the step (rank 3's from
    its keeper, the survivors' own) are, and the 3 left run one pipeline (pp2 x fsdp1), each stage's
    halves resharded into one rank by name."""
    kill = {"rank": 3, "step": 6, "point": "mid_step", "kind": "kill"}
    spec = _spec(4, 2, [kill], checkpoint={"memory_every_steps": 1})
    spec["parallel"]["plan"] = "fsdp"
    run = run_job(tmp_path, spec, name="pp2fsdp2")
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 3)], run.of("failure")
    rec = run.of("recovered")[0]
    assert rec["source"] == "memory" and rec["lost_steps"] <= 1, rec
    assert "lack (pipeline stage, shard coordinate) [(1, 1)]" in rec["reason"], rec
    assert [(e["old_world_size"], e["new_world_size"]) for e in run.of("resized")][:1] == [(4, 2)]
    _like_clean(run, CLEAN)


def test_pp2_dp2_hung_stage_rank_is_found_and_its_stage_served_by_the_replica(tmp_path, ray_local):
    """pp2 x dp2: rank 2 (stage 1, the one computing the loss) stops dead (SIGSTOP) mid-step. The watchdog
    names it (its peers wait in p2p and collectives, it is stuck computing), it is killed, and rank 3
    serves stage 1 to the next generation (one pipeline until the replacement is up): lost work the step
    in flight, numbers unchanged."""
    hang = {"rank": 2, "step": 10, "point": "mid_step", "kind": "hang"}
    # steps 0.1 s longer (no number changes): the first steps' records reach the controller before the
    # hang, so the watchdog's bound comes from observed step times (seconds), not the cap before any step
    spec = _spec(4, 2, [hang, *_slow(4, 0.07)])
    spec["timeouts"]["watchdog_floor_s"] = 2
    run = run_job(tmp_path, spec, name="pp2hang")
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("hang", 2)], run.of("failure")
    rec = run.of("recovered")[0]
    assert rec["source"] == "peer" and rec["lost_steps"] <= 1, rec
    assert "survivors [0, 3] hold every stage's every shard" in rec["reason"], rec
    # the 3 left run one whole pipeline while the replacement starts (elastic: no wait for it)
    assert [(e["old_world_size"], e["new_world_size"]) for e in run.of("resized")][:1] == [(4, 2)]
    _kept_their_process(run, [0, 1, 3])
    _like_clean(run, CLEAN)


def test_pp2_sigterm_then_resumed_under_ddp_and_fsdp_ends_with_the_clean_loss(tmp_path, ray_local):
    """A real SIGTERM to the driver of a pp2 run (what ``ray job stop`` and Kubernetes send; this process is
    the driver, so no second interpreter and Ray connection to start): it stops at a step boundary,
    commits, exits 75. The same job resumed under ddp on one worker, and a branch of it under fsdp on two,
    load both stages' entries by name into their layout and end with the uninterrupted run's loss."""
    import os
    import signal
    import threading

    from elastictrain.events import read_events

    ckpt = {"uri": str(tmp_path / "ckpt"), "every_steps": 0, "memory_every_steps": 0}
    # steps a quarter second longer (no number changes): the signal lands well before the last step
    spec = _spec(2, 2, _slow(2, 0.25), checkpoint=ckpt, name="ppterm")
    run_dir, done = tmp_path / "a", threading.Event()

    def term_at_step_5() -> None:
        while not done.wait(0.05):
            if (run_dir / "events.jsonl").exists() and any(
                    e["event"] == "step" and e["step"] >= 5 for e in read_events(run_dir)):
                os.kill(os.getpid(), signal.SIGTERM)
                return

    # the trainer's handler is in place during fit; before and after it, a stray SIGTERM does nothing here
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    sender = threading.Thread(target=term_at_step_5, daemon=True)
    sender.start()
    try:
        first = run_job(tmp_path, spec, name="a")
    finally:
        done.set()
        sender.join()
        signal.signal(signal.SIGTERM, previous)
    assert first.result.exit_code == 75, first.summary
    (pre,) = first.of("preempted")
    assert pre["checkpoint"] is True and 5 <= pre["step"] < STEPS and "SIGTERM" in pre["reason"], pre
    committed = str(tmp_path / "ckpt" / "ppterm" / f"step_{pre['step']:09d}")
    clean = _clean(CLEAN)
    assert_same_numbers(first, clean, steps=range(1, pre["step"] + 1), params=False)
    # the same job under ddp on one worker (resume: auto), then a branch of it under fsdp on two
    for name, parallel, workers, extra in (("ddp1", {"plan": "ddp"}, 1, {}),
                                           ("fsdp2", {"plan": "fsdp"}, 2, {"run_id": "ppterm-fsdp"})):
        # the job's own workers section with the size changed (a bare {"min", "max"} would drop BASE_JOB's
        # reuse and standby switches: processes started afresh, and a standby beside them)
        again = {**copy.deepcopy(spec), "parallel": parallel,
                 "workers": {**spec["workers"], "min": workers, "max": workers}, "faults": [], **extra}
        if extra:
            again["checkpoint"] = {**ckpt, "resume": committed}
        run = run_job(tmp_path, again, name=name)
        (resumed,) = run.of("resumed")
        assert resumed["step"] == pre["step"], (name, resumed)
        assert run.result.exit_code == 0 and run.summary["final_step"] == STEPS, (name, run.summary)
        assert_same_numbers(run, clean, steps=range(pre["step"] + 1, STEPS + 1), param_atol=RECOVERY_PARAM_ATOL)


def test_a_pp4_checkpoint_resumes_under_pp2_each_rank_loading_its_new_stage_by_name(tmp_path, ray_local):
    """A change of P between generations: a run under pp4 (one block per stage) commits step 8; a branch of
    it under pp2 (two blocks per stage: each new stage spans two old ones) loads its stages by name from
    that checkpoint, and its steps 9..16 have the uninterrupted pp4 run's losses."""
    task = {**TASK, "model": {**MODEL, "n_layer": 4}}
    ckpt = {"uri": str(tmp_path / "ckpt"), "every_steps": 8, "memory_every_steps": 0}
    # TIMEOUTS' restart grace: four cold workers took longer than the default 90 s to start on a loaded
    # machine (seen: "could not start 4 workers within timeouts.restart_grace_s=90", none up)
    pp4 = job(name="pp4", task=task, train=TRAIN, workers={"min": 4, "max": 4},
              parallel={"plan": "ddp", "pp": 4}, checkpoint=ckpt, timeouts=dict(TIMEOUTS))
    whole = run_job(tmp_path, pp4, name="pp4")
    assert whole.result.exit_code == 0 and whole.summary["checkpoints_committed"] == [8, STEPS], whole.summary
    branch = {**copy.deepcopy(pp4), "run_id": "pp4-to-pp2", "workers": {**pp4["workers"], "min": 2, "max": 2},
              "parallel": {"plan": "ddp", "pp": 2},
              "checkpoint": {**ckpt, "resume": str(tmp_path / "ckpt" / "pp4" / "step_000000008")}}
    run = run_job(tmp_path, branch, name="pp2")
    (resumed,) = run.of("resumed")
    assert resumed["step"] == 8 and run.result.exit_code == 0, (resumed, run.summary)
    assert_same_numbers(run, whole, steps=range(9, STEPS + 1), param_atol=RECOVERY_PARAM_ATOL)
