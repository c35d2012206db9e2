"""The peer memory tier's keepers are actors of one run: the run closes them when it ends, not the garbage
collector. A driver that keeps its Trainer (a notebook, ``benchmarks/parallel.py`` running one kill job after
another in one Ray) held every finished run's keepers and their snapshots: five 50.7M-parameter runs' keepers
(1.4-2.5 GB each) took the machine's memory until Ray's OOM killer stopped workers of the next run. Under
``workers.reuse`` (on in the suite's base job) a run's keeper outlives it in the driver's pool, emptied
(controller/keeper_pool.py): it holds no snapshot."""

from __future__ import annotations

import time

from ray._private.state import actors

import ray

from conftest import job
from elastictrain import Trainer, build_config
from elastictrain.controller.keeper_pool import KEEPERS
from elastictrain.controller.warm_pool import current_session


def _keepers() -> dict[str, str]:
    """ActorID -> state of every ShardKeeper actor the GCS knows (any run's, dead ones too)."""
    return {a["ActorID"]: a["State"] for a in actors().values() if a["ActorClassName"] == "ShardKeeper"}


def test_a_finished_run_leaves_no_keeper_alive(ray_local, tmp_path):
    earlier = set(_keepers())
    idle = KEEPERS.nodes()  # reuse off: the pool is neither taken from nor added to
    trainer = Trainer(build_config(job(train={"steps": 2}, workers={"min": 1, "max": 1, "reuse": False},
                                       checkpoint={"memory_every_steps": 1})), run_dir=tmp_path / "run", console=None)
    assert trainer.fit().ok
    mine = set(_keepers()) - earlier
    assert mine, "the run started no ShardKeeper: the tier was off, the test proves nothing"
    # the Trainer is still referenced here, as a driver keeps its Trainer. ray.kill is asynchronous: the GCS
    # marks the actor dead once its process is gone, so wait for that (bounded; no timing is asserted). On
    # the old code the keeper lives as long as the Trainer, and the wait ends with it alive
    deadline = time.monotonic() + 60
    while any(_keepers()[k] != "DEAD" for k in mine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_keepers()[k] == "DEAD" for k in mine), f"keepers alive after fit() returned: {_keepers()}"
    assert trainer.controller.sources.keepers == {}
    assert KEEPERS.nodes() == idle


def test_under_reuse_a_finished_runs_keeper_is_pooled_holding_nothing(ray_local, tmp_path):
    KEEPERS.clear()
    trainer = Trainer(build_config(job(train={"steps": 2}, workers={"min": 1, "max": 1},
                                       checkpoint={"memory_every_steps": 1})), run_dir=tmp_path / "run", console=None)
    assert trainer.fit().ok and trainer.controller.sources.keepers == {}
    (node,) = KEEPERS.nodes()
    keeper = KEEPERS.take(current_session(), node)
    try:  # the run put a snapshot every step: none is left
        assert ray.get(keeper.stats.remote(), timeout=60) == {"bytes": 0, "entries": 0}
    finally:
        ray.kill(keeper, no_restart=True)
