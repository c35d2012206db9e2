"""The peer memory tier's keepers pooled between runs of one driver (``workers.reuse``,
elastictrain/controller/keeper_pool.py): a reused keeper holds nothing of the run that gave it back, and a
run on it recovers from memory with the same numbers as on a fresh keeper."""

from __future__ import annotations

import pytest
import ray
import torch

from elastictrain.checkpoint.memory import KeeperState
from elastictrain.checkpoint.memory_dcp import take_snapshot
from elastictrain.controller.keeper_pool import KEEPERS
from elastictrain.controller.warm_pool import current_session
from tests.conftest import job, run_job


def test_reset_drops_every_snapshot_and_the_budget():
    state = KeeperState(1 << 20)
    for step in (3, 6):
        assert state.put(take_snapshot({"w": torch.ones(4) * step}, rank=0, step=step, generation=0)).accepted
    assert state.stats()["entries"] == 2
    assert state.reset(1) == {"bytes": 0, "entries": 0} and state.catalog() == []
    # a late put of the run that gave the keeper back: refused (budget 1 byte), not kept
    late = state.put(take_snapshot({"w": torch.ones(4)}, rank=0, step=9, generation=0))
    assert not late.accepted and state.stats()["entries"] == 0
    # taken by the next run: its own budget, and its step 3 is kept (not "not newer than" a leftover)
    assert state.reset(1 << 20)["entries"] == 0
    assert state.put(take_snapshot({"w": torch.zeros(4)}, rank=0, step=3, generation=0)).accepted



def test_a_late_put_of_the_run_before_is_refused_after_the_next_run_took_the_keeper():
    """Every put carries its run's lease: a snapshot of run A still on its way when run B has taken the
    keeper (reset to B's budget and lease) is refused, although its (generation, rank, step) key is one B
    uses too; B's own is kept. A keeper started without a lease takes any put."""
    snap = lambda v, step: take_snapshot({"w": torch.ones(4) * v}, rank=0, step=step, generation=0)  # noqa: E731
    state = KeeperState(1 << 20, lease="A")
    assert state.put(snap(1, 3), "A").accepted
    assert state.reset(1, "idle")["entries"] == 0  # given back to the pool
    assert state.reset(1 << 20, "B")["entries"] == 0  # taken by run B
    late = state.put(snap(1, 6), "A")
    assert not late.accepted and "no longer serves" in late.reason and state.stats()["entries"] == 0
    assert state.put(snap(2, 6), "B").accepted and [m.step for m in state.catalog()] == [6]
    assert KeeperState(1 << 20).put(snap(1, 3), "anything").accepted

def _spec(seed: int) -> dict:
    # one worker killed at step 7: nothing survives, the keeper's snapshot (step 6, or 3) restores the run
    return job(train={"steps": 9, "seed": seed}, workers={"min": 1, "max": 1},
               checkpoint={"memory_every_steps": 3},
               faults=[{"rank": 0, "step": 7, "point": "mid_step", "kind": "kill"}])


def _recovered_from_memory(run) -> None:
    (rec,) = run.of("recovered")
    assert rec["source"] == "memory" and rec["step"] in (3, 6), rec  # step 6 may be in flight at the kill
    assert run.summary["final_step"] == 9 and run.result.exit_code == 0


@pytest.mark.slow
def test_reused_keeper_holds_nothing_and_recovers_like_a_fresh_one(tmp_path, ray_local):
    KEEPERS.clear()  # this sequence counts its own keepers
    started = KEEPERS.started
    a = run_job(tmp_path, _spec(seed=1), name="A")  # fresh keeper, then given back emptied
    _recovered_from_memory(a)
    assert KEEPERS.started == started + 1
    (node,) = KEEPERS.nodes()
    pooled = KEEPERS.take(current_session(), node)
    assert pooled is not None
    assert ray.get(pooled.stats.remote()) == {"bytes": 0, "entries": 0}
    assert ray.get(pooled.catalog.remote()) == []
    KEEPERS.give(current_session(), node, pooled)
    # B: another seed on the reused keeper (a leftover of A at the same (generation, rank, step) would be
    # restored as B's state); C: B again on a fresh keeper. Every step's loss and the final parameters agree.
    reused = KEEPERS.reused
    b = run_job(tmp_path, _spec(seed=2), name="B")
    assert KEEPERS.reused == reused + 1 and KEEPERS.started == started + 1
    _recovered_from_memory(b)
    KEEPERS.clear()
    c = run_job(tmp_path, _spec(seed=2), name="C")
    assert KEEPERS.started == started + 2
    _recovered_from_memory(c)
    assert b.losses() == c.losses() and len(b.losses()) == 9
    assert b.losses() != a.losses()
    pb, pc = b.final_params(), c.final_params()
    assert pb.keys() == pc.keys() and all(torch.equal(pb[k], pc[k]) for k in pb)
    KEEPERS.clear()

