"""Peer memory tier: keeper budget/eviction logic, ring placement, and the real actor + replicator on a
local Ray, read back through the DCP snapshot reader."""

from __future__ import annotations

import time

import pytest
import torch

from elastictrain.checkpoint.memory import KeeperSource, KeeperState, MemoryReplicator, ShardKeeper, keeper_ring
from elastictrain.checkpoint.memory_dcp import SnapshotReader, take_snapshot


def _snap(rank: int, step: int, n_floats: int, value: float = 1.0, generation: int = 0):
    return take_snapshot({"model": {"w": torch.full((n_floats,), value)}}, rank=rank, step=step,
                         generation=generation)


def test_keeper_keeps_two_steps_per_rank_evicts_oldest_and_rejects_oversize() -> None:
    k = KeeperState(budget_bytes=1000)
    assert k.put(_snap(0, 1, 100)).accepted  # 400 bytes
    assert k.put(_snap(1, 1, 100)).accepted  # 800
    r = k.put(_snap(2, 1, 100))  # 1200 > 1000: rank 0's (oldest put) goes
    assert r.accepted and r.evicted == [(0, 0, 1)] and "evicted" in r.reason
    assert {(m.rank, m.step) for m in k.catalog()} == {(1, 1), (2, 1)}
    assert k.put(_snap(1, 2, 50)).accepted and k.put(_snap(1, 3, 50)).accepted  # keeps steps 2, 3 of rank 1
    assert sorted(m.step for m in k.catalog() if m.rank == 1) == [2, 3]
    big = k.put(_snap(3, 1, 300))
    assert not big.accepted and "exceed the keeper budget of 1000 bytes" in big.reason and big.rank == 3
    stale = k.put(_snap(1, 1, 10))
    assert not stale.accepted and "not newer" in stale.reason
    assert k.put(_snap(1, 1, 10, generation=1)).accepted  # another generation is another series
    with pytest.raises(KeyError, match="rank 7"):
        k.fetch(0, 7, 1, [])
    with pytest.raises(ValueError, match="budget"):
        KeeperState(0)


def test_keeper_ring_never_uses_own_node_unless_alone() -> None:
    assert keeper_ring(["b", "a", "c", "a"], ["a", "b", "c"]) == ["c", "b", "a", "b"]
    assert keeper_ring(["a", "b"], ["a", "b"]) == ["b", "a"]
    assert keeper_ring(["x"], ["a", "b"]) == ["a"]  # a node without keeper: the next in the ring
    assert keeper_ring(["a"], ["a"]) == ["a"]  # single node: only process deaths are covered
    assert keeper_ring(["a"], []) == [None]


def test_actor_replicator_and_reader(ray_local) -> None:
    import ray

    keeper = ShardKeeper.remote(10_000_000)
    rep = MemoryReplicator(keeper, rank=1, generation=3, timeout_s=30)
    state = {"model": {"w": torch.full((1000,), 1.0)}, "progress": {"step": 5}}
    rep.push(5, state)
    state["model"]["w"].fill_(-1.0)  # the push already copied the tensors
    for step in (6, 7, 8):  # pushes issued while one is in flight: older waiting ones are replaced
        rep.push(step, {"model": {"w": torch.full((1000,), float(step))}, "progress": {"step": step}})
    assert rep.flush(timeout=30)
    out = rep.reports()
    assert out["snapshots"] == 4 and out["stall_s"] > 0
    assert all(r.accepted for r in out["results"]) and 1 <= len(out["results"]) <= 4
    (meta,) = [m for m in ray.get(keeper.catalog.remote()) if m.step == 8]
    target = {"model": {"w": torch.zeros(1000)}, "progress": {"step": 0}}
    import torch.distributed.checkpoint as dcp

    dcp.load(target, storage_reader=SnapshotReader([KeeperSource(keeper, meta, timeout_s=30)]), no_dist=True)
    assert torch.equal(target["model"]["w"], torch.full((1000,), 8.0)) and target["progress"] == {"step": 8}
    # the rank keeps its newest two itself (a lost keeper's are served from here), each intact
    own = rep.own()
    assert [o.meta.step for o in own] == [7, 8]
    assert [float(o.fetch([("model.w", (0,))])[("model.w", (0,))][0]) for o in own] == [7.0, 8.0]
    rep.push(9, {"model": {"w": torch.full((1000,), 9.0)}, "progress": {"step": 9}})
    assert rep.flush(timeout=30)
    assert [o.meta.step for o in rep.own()] == [8, 9]
    assert rep.own()[1].data[("model.w", (0,))] is own[0].data[("model.w", (0,))]  # step 7's buffer, refilled
    assert float(rep.own()[0].data[("model.w", (0,))][0]) == 8.0
    alone = MemoryReplicator(keeper, rank=2, keep_own=False)  # keeper on the rank's own node: one set of buffers
    for step in (1, 2):
        alone.push(step, {"model": {"w": torch.full((10,), float(step))}})
        assert alone.flush(timeout=30)
    assert [o.meta.step for o in alone.own()] == [2]
    alone.close(timeout=30)
    ray.kill(keeper)
    # ray.kill only asks Ray to end the actor: a call sent right after can still reach the live keeper
    # (CI saw it accepted). Wait until a call fails, so the push below meets a dead keeper.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(keeper.catalog.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        except ray.exceptions.GetTimeoutError:  # a dying actor's call may hang a while: ask again
            continue
    else:
        raise AssertionError("the killed keeper still answered after 60 s")
    rep.reports()
    rep.push(10, {"model": {"w": torch.zeros(10)}})
    assert rep.flush(timeout=60)
    (dead,) = rep.reports()["results"]
    assert not dead.accepted and "to its keeper failed" in dead.reason and dead.step == 10
    rep.close(timeout=30)
