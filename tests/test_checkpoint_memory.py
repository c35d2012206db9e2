"""In-memory tier: keeper budget/eviction logic, and the real actor + replicator on a local Ray."""

from __future__ import annotations

import pytest
import torch

from elastictrain.checkpoint.memory import KeeperState, MemoryReplicator, ShardKeeper


@pytest.fixture(scope="module")
def _own_ray():
    """Fallback when the suite has no shared ``ray_local``: a module-scoped local Ray of our own."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def ray_ctx(request: pytest.FixtureRequest) -> None:
    try:
        request.getfixturevalue("ray_local")  # the suite's shared local Ray, when tests/conftest.py has it
    except pytest.FixtureLookupError:
        request.getfixturevalue("_own_ray")


def _snap(n_floats: int, value: float = 1.0) -> dict:
    return {"model": {"w": torch.full((n_floats,), value)}, "optim": {"lr": 0.1}}


def test_keeper_budget_evicts_oldest_other_rank_and_rejects_oversize() -> None:
    k = KeeperState(budget_bytes=1000)
    assert k.put(0, 1, _snap(100)).accepted  # 400 bytes
    assert k.put(1, 1, _snap(100)).accepted  # 800
    r = k.put(2, 1, _snap(100))  # 1200 > 1000: rank 0 (oldest) goes
    assert r.accepted and r.evicted == [(0, 1)] and "evicted" in r.reason
    assert k.get(0) is None and k.stats() == {"bytes": 800, "entries": 2}
    assert k.put(1, 2, _snap(150)).accepted  # replaces its own older snapshot: 600 + 400 fits
    assert k.get(1)[0] == 2 and k.get(1, step=1) is None
    big = k.put(3, 1, _snap(300))
    assert not big.accepted and "exceed the keeper budget" in big.reason
    stale = k.put(1, 1, _snap(10))
    assert not stale.accepted and "older" in stale.reason
    with pytest.raises(ValueError, match="budget"):
        KeeperState(0)


def test_actor_and_replicator(ray_ctx) -> None:
    import ray

    keeper = ShardKeeper.remote(10_000_000)
    rep = MemoryReplicator(keeper, rank=1)
    state = _snap(1000, 1.0)
    rep.push_async(5, state)
    state["model"]["w"].fill_(-1.0)  # the push already copied the tensors
    for step in (6, 7, 8):  # pushes issued while one is in flight: older queued ones are dropped
        rep.push_async(step, _snap(1000, float(step)))
    results = rep.flush(timeout=30)
    assert all(r.accepted for r in results) and 1 <= len(results) <= 4
    step, got = ray.get(keeper.get.remote(1))
    assert step == 8 and torch.equal(got["model"]["w"], torch.full((1000,), 8.0))
    assert ray.get(keeper.get.remote(1, 5)) is None
    assert ray.get(keeper.stats.remote()) == {"bytes": 4000, "entries": 1}
    ray.kill(keeper)
    rep.push_async(9, _snap(10))
    (dead,) = rep.flush(timeout=30)
    assert not dead.accepted and "keeper failed" in dead.reason
