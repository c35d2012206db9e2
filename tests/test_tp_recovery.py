"""Tensor parallel recovers like every other layout (real Ray, real gloo, real SIGKILL): a dead rank's TP
shard comes from the data-parallel replica of its (pp, tp) coordinate (tp2 x dp2), else the peer memory
tier (tp2 alone); the world shrinks to whole TP groups (tp2 x dp1) and grows back. Each run ends with the
loss of an uninterrupted one and every step saw exactly its samples (the audit)."""

from __future__ import annotations

import copy

from tests.conftest import BASE_JOB, job, run_job
from tests.grow_gate import assert_held_one_step, hold_until_grown
from tests.parallel_fixtures import assert_grew_back_from_the_last_step, assert_same_numbers
from tests.test_pp_recovery import TIMEOUTS, _audit, _clean, _kept_their_process, _slow

STEPS = 16
TASK = copy.deepcopy(BASE_JOB["task"])  # 2 heads, d_model 32: every TP dimension divides by 2
TRAIN = {"steps": STEPS, "global_batch": 16, "micro_batch": 2}
# the uninterrupted reference: one process (the worker's step loop in the test's own process), the same math (tp2 differs by fp32 sum order only; dropout masks
# are a function of (seed, step, sample, position), never of the shard)
CLEAN = job(task=TASK, train=TRAIN, workers={"min": 1, "max": 1})


def _spec(world: int, min_workers: int, faults: list[dict], **sections) -> dict:
    """A tp2 job (ddp over what tp leaves) on ``world`` workers."""
    spec = job(task=TASK, train={**TRAIN, "audit_samples": True}, workers={"min": min_workers, "max": world},
               parallel={"plan": "ddp", "tp": 2}, faults=_slow(world) + faults,
               recovery={"min_workers_wait_s": 240}, timeouts=dict(TIMEOUTS), **sections)  # test_pp_recovery's
    return copy.deepcopy(spec)


def _like_clean(run, clean: dict) -> None:
    """Finished, every step saw its samples, every step's loss (a redone one too) within 1e-5 relative of
    the uninterrupted run's and the final parameters within 1e-4 absolute: tp's tolerance
    (tests/test_tensor_parallel.py: one element of blocks.1.mlp_out.weight differs by 1.2e-5 in every tp
    layout, its gradient at the rounding level of its sum)."""
    steps = clean["train"]["steps"]
    assert run.result.exit_code == 0 and run.summary["final_step"] == steps, run.summary
    _audit(run, steps)
    assert_same_numbers(run, _clean(clean), param_atol=1e-4)


def test_tp2_dp2_rank_killed_recovers_from_its_replica_shrinks_to_one_tp_group_and_grows(tmp_path, ray_local):
    """tp2 x dp2 on 4 (replica 0 = ranks 0,1 on tp coordinates 0,1; replica 1 = ranks 2,3): rank 1 is
    SIGKILLed mid-step with no spare. Rank 3 holds tp coordinate 1 and rank 0 coordinate 0: the survivors
    serve their shards (no keeper, no storage), the 3 left fold to whole TP groups (tp2 x dp1) and grow
    back to 4 once the replacement is up (the folded generation is held before its first step until then:
    tests/grow_gate.py)."""
    kill = {"rank": 1, "step": 6, "point": "mid_step", "kind": "kill"}
    run = run_job(tmp_path, _spec(4, 2, [kill, *hold_until_grown(2)]), name="tp2dp2")
    # rank 2, blocked in the data-parallel gradient all-reduce with rank 0, fails at once when rank 0 releases
    # its groups (DTensor's caches no longer keep them: parallel/mesh.py), not after timeouts.collective_s
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 1)], run.of("failure")
    rec = run.of("recovered")[0]
    assert rec["source"] == "peer" and rec["lost_steps"] <= 1, rec
    assert "survivors [0, 3] hold every tp coordinate's every shard" in rec["reason"], rec
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in run.of("resized")]
    assert sizes[:2] == [(4, 2), (2, 4)], sizes  # whole TP groups only: 3 workers run one
    assert_grew_back_from_the_last_step(run)
    assert_held_one_step(run)
    _kept_their_process(run, [0, 2, 3])
    _like_clean(run, CLEAN)


def test_tp2_rank_killed_recovers_from_the_peer_memory_tier(tmp_path, ray_local):
    """tp2 alone on 2: rank 1 holds the only copy of tp coordinate 1 and is SIGKILLed mid-step; the peer
    tier (a snapshot every step) holds it. The replacement loads its shard from the keeper, rank 0 its own."""
    kill = {"rank": 1, "step": 6, "point": "mid_step", "kind": "kill"}
    run = run_job(tmp_path, _spec(2, 2, [kill], checkpoint={"memory_every_steps": 1}), name="tp2mem")
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 1)], run.of("failure")
    rec = run.of("recovered")[0]
    assert rec["source"] == "memory" and rec["lost_steps"] <= 1, rec
    assert "lack (tp coordinate, shard coordinate) [(1, 0)]" in rec["reason"], rec
    _kept_their_process(run, [0])
    _like_clean(run, CLEAN)
