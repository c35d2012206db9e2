"""Recovery of sharded state end to end (real Ray, real gloo, real SIGKILL by pid): FSDP with the peer
memory tier, and HSDP whose other replica group serves the broken group's shards."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import BackgroundRun, job
from tests.grow_gate import assert_held_one_step, hold_until_grown
from tests.parallel_fixtures import (RECOVERY_PARAM_ATOL, InProcessRun, assert_grew_back_from_the_last_step,
                                     assert_same_numbers)

STEPS = 30


def _spec(plan: str, world: int, min_workers: int = 1, extra_faults: tuple = (), mode: str = "elastic",
          **sections):
    slow = [{"rank": r, "step": 1, "kind": "slow", "seconds": 0.03, "generation": None} for r in range(world)]
    slow += list(extra_faults)
    return job(train={"steps": STEPS, "global_batch": 16, "micro_batch": 2, "audit_samples": True},
               workers={"min": min_workers, "max": world}, parallel={"plan": plan}, faults=slow,
               recovery={"min_workers_wait_s": 240, "mode": mode}, timeouts={**job()["timeouts"], "watchdog_floor_s": 10, "restart_grace_s": 240},
               **sections)


@pytest.fixture(scope="module")
def clean():
    """The uninterrupted run (one process, the worker's step loop in this one; the layouts differ from it by
    fp32 sum order; the slow steps change no number)."""
    return InProcessRun(_spec("ddp", 1))


def _tier_complete_step(bg: BackgroundRun, world: int) -> int:
    """The newest step of which the run's keepers hold every rank's generation-0 snapshot (-1: none yet):
    under fsdp every rank pushes its own shard. Asked of the keepers themselves (real Ray calls), not
    inferred from how far the run has got."""
    import ray

    keepers = list(bg.trainer.controller.sources.keepers.values())
    held: dict[int, set[int]] = {}
    for metas in ray.get([k.catalog.remote() for k in keepers], timeout=120):
        for m in metas:
            if m.generation == 0:
                held.setdefault(m.step, set()).add(m.rank)
    return max((s for s, ranks in held.items() if ranks == set(range(world))), default=-1)


def _kill_rank_1(tmp_path, spec, name, ranks=(1,), world: int = 2, tier: bool = True):
    """SIGKILL ``ranks`` (by pid, one right after the other) once the run is past step 8 and, with the peer
    tier on, once its keepers hold a complete step at least as new as the step reported then: the kill waits
    for that condition, not for a step number standing for "the tier has caught up by now" (a keeper slow to
    come up on a loaded machine held nothing at step 8, and the run restarted from scratch). From step 9 the
    first generation's steps take a second more each, so the run is still there to be killed (tens of
    seconds, not the 0.7 s steps 9-30 take unslowed); no number changes."""
    import time

    held_open = [{"rank": r, "step": 9, "kind": "slow", "seconds": 1.0, "generation": 0} for r in range(world)]
    spec = {**spec, "faults": list(spec["faults"]) + held_open}
    bg = BackgroundRun(tmp_path, spec, name=name)
    victims = [bg.wait_for(lambda e, r=r: e["event"] == "worker_started" and e["rank"] == r, timeout=240)
               for r in ranks]
    reported = bg.wait_for(lambda e: e["event"] == "step" and e["step"] >= 8, timeout=240)["step"]
    deadline = time.monotonic() + 240  # bounds a hang, not the tier's speed
    while tier and _tier_complete_step(bg, world) < reported:
        assert time.monotonic() < deadline and bg.thread.is_alive(), f"the tier never held a complete step >= {reported}"
        bg.thread.join(0.05)
    for victim in victims:
        os.kill(victim["pid"], signal.SIGKILL)
    return bg.finish(timeout=480)


def _audit(run, global_batch=16, seq_len=32, steps=STEPS) -> None:
    """Every step 1..STEPS ran and saw exactly its global-cursor samples; a step redone after a restore
    from the peer tier saw the same samples both times."""
    from elastictrain.data.cursor import step_sample_ids
    from elastictrain.data.datasets import TokenWindows, load_text_tokens

    n = len(TokenWindows(load_text_tokens("builtin:pydoc"), seq_len))
    seen: dict[int, list[int]] = {}
    for e in run.of("step"):
        ids = sorted(e["sample_ids"])
        assert ids == sorted(step_sample_ids(e["step"] - 1, global_batch, 0, n).tolist()), e["step"]
        assert seen.setdefault(e["step"], ids) == ids
    assert sorted(seen) == list(range(1, steps + 1))


def _finished_like_clean(run, clean: InProcessRun, steps: int = STEPS) -> None:
    """Finished, every step saw its samples, and every step's loss (a step redone after a restore from the
    tier too) and the final parameters are the uninterrupted run's (tests/parallel_fixtures.py)."""
    assert run.result.exit_code == 0 and run.summary["final_step"] == steps
    _audit(run, steps=steps)
    assert_same_numbers(run, clean, param_atol=RECOVERY_PARAM_ATOL)


def test_fsdp_rank_killed_recovers_from_peer_memory_tier(tmp_path, ray_local, clean):
    """Pure FSDP: the dead rank's shard exists nowhere among the survivors; the peer tier holds it."""
    run = _kill_rank_1(tmp_path, _spec("fsdp", 2, checkpoint={"memory_every_steps": 1}), "fsdp")
    rec = run.of("recovered")[0]
    assert rec["source"] == "memory", rec
    assert rec["lost_steps"] <= 2, rec  # interval 1; one snapshot may be in flight at the kill
    assert "lack shard coordinates [1]" in rec["reason"]
    _finished_like_clean(run, clean)


def test_fsdp_two_ranks_killed_at_once_recover_from_peer_memory_tier(tmp_path, ray_local, clean):
    """fsdp on 4: ranks 1 and 2 die together; the survivors 0 and 3 lack two shard coordinates, which only
    the keeper holds. Lost work <= two intervals (the newest snapshot may still be in flight at the kill).
    strict: two replacements load their shards from the keeper at world size 4."""
    spec = _spec("fsdp", 4, mode="strict", checkpoint={"memory_every_steps": 2})
    run = _kill_rank_1(tmp_path, spec, "fsdp2", ranks=(1, 2), world=4)
    assert {(f["kind"], f["rank"]) for f in run.of("failure")} >= {("process_died", 1), ("process_died", 2)}
    rec = run.of("recovered")[0]
    assert rec["source"] == "memory" and 0 <= rec["lost_steps"] <= 4, rec
    assert "lack shard coordinates [1, 2]" in rec["reason"], rec
    assert f"lost {rec['lost_steps']} completed step(s)" in rec["reason"], rec  # the text counts as the event does
    _finished_like_clean(run, clean)


def test_fsdp_two_ranks_killed_fold_to_two_and_grow_back_to_four(tmp_path, ray_local, clean):
    """Elastic: fold 4 -> 2 from the keeper, then grow back 2 -> 4 from the two survivors' snapshots. The
    survivor that was rank 3 of the first 4-rank mesh is rank 1 of the regrown one; with DTensor's
    per-thread caches still holding the first, equal-looking mesh it loaded rank 3's rows (seen: loss 5.09
    instead of 3.78 at the end). The folded generation is held before its first step until the replacements
    are ready (tests/grow_gate.py): it trains one step at 2, then grows back."""
    spec = _spec("fsdp", 4, extra_faults=hold_until_grown(2), checkpoint={"memory_every_steps": 2})
    run = _kill_rank_1(tmp_path, spec, "fsdp", ranks=(1, 2), world=4)
    rec = run.of("recovered")[0]
    assert rec["source"] == "memory" and 0 <= rec["lost_steps"] <= 4, rec
    assert f"lost {rec['lost_steps']} completed step(s)" in rec["reason"], rec
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in run.of("resized")]
    assert sizes[:2] == [(4, 2), (2, 4)], sizes
    assert_grew_back_from_the_last_step(run)  # from the two survivors' live state, not the keeper's
    _finished_like_clean(run, clean)


def test_hsdp_broken_shard_group_recovers_from_the_other_replica(tmp_path, ray_local, clean):
    """HSDP on 4 (2 replica groups x 2 shards): rank 1 dies; ranks 0 and 3 hold shards 0 and 1 at the
    newest step and serve them; the group folds to 2 and grows back. No storage, no keeper."""
    # the folded generation (1) is held before its first step until the replacement is ready, so the
    # grow-back happens however slow the machine (tests/grow_gate.py)
    run = _kill_rank_1(tmp_path, _spec("hsdp", 4, min_workers=2, extra_faults=hold_until_grown(2)), "hsdp",
                       tier=False)
    # only the killed rank fails: rank 2, blocked in a replica all-reduce with rank 0 when rank 0 left the
    # failed step, is released at once by rank 0 letting go of its groups (not declared hung)
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 1)], run.of("failure")
    rec = run.of("recovered")[0]
    assert rec["source"] == "peer" and rec["lost_steps"] == 0, rec
    # the covering ranks serve: one per shard coordinate (rank 2 survives too, so [2, 3] covers as well)
    assert "survivors [0, 3] hold every shard" in rec["reason"] or "survivors [2, 3] hold every shard" in rec["reason"], rec
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in run.of("resized")]
    assert sizes[:2] == [(4, 2), (2, 4)], sizes  # folded, then grew back from the survivors' snapshots
    assert_grew_back_from_the_last_step(run)
    assert_held_one_step(run)
    _finished_like_clean(run, clean)
