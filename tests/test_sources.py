"""The pure ranking of recovery sources (survivor replicas, peer memory tier, durable checkpoint)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from elastictrain.controller.sources import KINDS, rank_sources


def test_ddp_any_survivor_is_a_complete_replica() -> None:
    d = rank_sources(dp_replicate=4, dp_shard=1, survivors={2: 10, 3: 10}, memory={8: True}, durable_step=5,
                     last_step=10)
    assert d.chosen.kind == "peer" and d.chosen.ranks == (2,) and d.lost_steps == 0
    assert [c.kind for c in d.ranked] == ["peer", "memory", "checkpoint", "scratch"]


def test_hsdp_needs_one_survivor_per_shard_coordinate() -> None:
    # mesh 2 x 2: ranks 0,1 form replica 0 (shards 0,1), ranks 2,3 replica 1
    ok = rank_sources(dp_replicate=2, dp_shard=2, survivors={0: 7, 3: 7}, memory={}, durable_step=None, last_step=7)
    assert ok.chosen.kind == "peer" and ok.chosen.ranks == (0, 3)
    broken = rank_sources(dp_replicate=2, dp_shard=2, survivors={1: 7, 3: 7}, memory={6: True, 7: False},
                          durable_step=4, last_step=7)
    assert broken.chosen.kind == "memory" and broken.chosen.step == 6 and broken.lost_steps == 1
    assert "lack shard coordinates [0]" in broken.reason


def test_fsdp_loses_a_shard_and_falls_back_in_order() -> None:
    d = rank_sources(dp_replicate=1, dp_shard=4, survivors={0: 9, 1: 9, 2: 9}, memory={}, durable_step=5,
                     last_step=9)
    assert d.chosen.kind == "checkpoint" and d.lost_steps == 4 and "holds no snapshot" in d.reason
    none = rank_sources(dp_replicate=1, dp_shard=4, survivors={}, memory={3: False}, durable_step=None,
                        last_step=9)
    assert none.chosen.kind == "scratch" and none.lost_steps == 9 and "incomplete" in none.reason
    with pytest.raises(ValueError, match="dp_shard=0"):
        rank_sources(dp_replicate=1, dp_shard=0, survivors={}, memory={}, durable_step=None, last_step=0)


def test_a_survivor_behind_does_not_count() -> None:
    # rank 1 missed the last optimizer step: only rank 0 holds step 5, and it covers shard 0 only
    d = rank_sources(dp_replicate=1, dp_shard=2, survivors={0: 5, 1: 4}, memory={5: True}, durable_step=None,
                     last_step=5)
    assert d.chosen.kind == "memory" and d.lost_steps == 0


def test_pipeline_peer_needs_every_stage() -> None:
    # pp2 alone: rank 0 holds stage 0 only; the old rule (any survivor of a one-shard mesh) took it as a whole state
    alone = rank_sources(pp=2, dp_replicate=1, dp_shard=1, survivors={0: 5}, memory={5: True}, durable_step=3,
                         last_step=5)
    assert alone.chosen.kind == "memory" and alone.lost_steps == 0
    assert "lack (pipeline stage, shard coordinate) [(1, 0)]" in alone.reason
    # pp2 x dp2 (ddp): stage 0 is ranks 0,1 and stage 1 ranks 2,3; rank 1 died, a replica of each stage lives
    replica = rank_sources(pp=2, dp_replicate=2, dp_shard=1, survivors={0: 7, 2: 7, 3: 7}, memory={},
                           durable_step=None, last_step=7)
    assert replica.chosen.kind == "peer" and replica.chosen.ranks == (0, 2) and replica.lost_steps == 0
    both = rank_sources(pp=2, dp_replicate=2, dp_shard=1, survivors={0: 7, 1: 7}, memory={}, durable_step=4,
                        last_step=7)
    assert both.chosen.kind == "checkpoint" and "[(1, 0)]" in both.reason
    # pp2 x hsdp 2x2 (world 8): stage 1 is ranks 4..7; one survivor per (stage, shard coordinate)
    hsdp = rank_sources(pp=2, dp_replicate=2, dp_shard=2, survivors={0: 3, 3: 3, 5: 3, 6: 3}, memory={},
                        durable_step=None, last_step=3)
    assert hsdp.chosen.kind == "peer" and hsdp.chosen.ranks == (0, 3, 6, 5)
    with pytest.raises(ValueError, match="pp=0"):
        rank_sources(pp=0, dp_replicate=1, dp_shard=1, survivors={}, memory={}, durable_step=None, last_step=0)


meshes = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4))


@settings(max_examples=400, deadline=None)
@given(mesh=meshes, data=st.data())
def test_ranking_properties(mesh, data) -> None:
    pp, rep, shard = mesh
    d_size = rep * shard
    world = pp * d_size
    last = data.draw(st.integers(0, 50))
    alive = data.draw(st.sets(st.integers(0, world - 1)))
    survivors = {r: data.draw(st.integers(max(0, last - 1), last)) for r in alive}
    memory = data.draw(st.dictionaries(st.integers(0, last), st.booleans(), max_size=4))
    durable = data.draw(st.none() | st.integers(0, last))
    d = rank_sources(pp=pp, dp_replicate=rep, dp_shard=shard, survivors=survivors, memory=memory,
                     durable_step=durable, last_step=last)
    # the chosen source is the newest viable one, ties to the earlier kind; scratch is always last resort
    assert d.chosen == d.ranked[0] and d.ranked[-1].kind == "scratch"
    keys = [(-c.step, KINDS.index(c.kind)) for c in d.ranked]
    assert keys == sorted(keys)
    assert d.lost_steps == last - d.chosen.step >= 0
    # peer is viable exactly when the survivors at the newest survivor step cover every (pipeline stage,
    # shard coordinate): rank r is in stage r // D and holds shard r % dp_shard of it (row-major mesh)
    newest = max(survivors.values(), default=None)
    every = {(p, j) for p in range(pp) for j in range(shard)}
    covered = {(r // d_size, r % shard) for r, s in survivors.items() if s == newest}
    peer = [c for c in d.ranked if c.kind == "peer"]
    assert bool(peer) == (newest is not None and covered == every)
    if peer:
        (p,) = peer
        assert p.step == newest and sorted((r // d_size, r % shard) for r in p.ranks) == sorted(every)
        assert all(survivors[r] == newest for r in p.ranks)
    mem = [c for c in d.ranked if c.kind == "memory"]
    complete = [s for s, ok in memory.items() if ok]
    assert [c.step for c in mem] == ([max(complete)] if complete else [])
    assert [c.step for c in d.ranked if c.kind == "checkpoint"] == ([] if durable is None else [durable])
    # DDP (one shard, one stage) with a survivor at the newest step loses only the step in flight
    if shard == 1 and pp == 1 and newest == last:
        assert d.chosen.kind == "peer" and d.lost_steps <= 1


def test_storage_is_needed_only_when_survivors_and_the_tier_do_not_cover() -> None:
    from elastictrain.controller.sources import storage_needed

    def ranked(memory: dict[int, bool], survivors: dict[int, int]):
        return rank_sources(dp_replicate=1, dp_shard=2, survivors=survivors, memory=memory, durable_step=None,
                            last_step=9, storage_asked=False)

    tier = ranked({8: True}, {0: 9})  # shard 1's holder is gone: the tier's step 8 covers
    assert tier.chosen.kind == "memory" and "storage not asked" in tier.reason
    assert not storage_needed(tier, []) and not storage_needed(tier, [4, 8])
    assert storage_needed(tier, [9])                  # this run committed a newer step than the tier holds
    assert storage_needed(ranked({8: False}, {0: 9}), [])  # incomplete tier: storage may hold the state
    assert not storage_needed(ranked({}, {0: 9, 1: 9}), [])  # survivors cover it


def test_served_snapshots_must_be_the_asked_rank_step_and_generation() -> None:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    from elastictrain.checkpoint.memory_dcp import SnapshotMeta
    from elastictrain.controller.sources import check_served

    def meta(rank: int, step: int = 5, gen: int = 3) -> SnapshotMeta:  # rank r holds rows 2r..2r+1 of w (4x3)
        chunk = ChunkStorageMetadata(torch.Size([2 * rank, 0]), torch.Size([2, 3]))
        md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]), [chunk])
        return SnapshotMeta(rank, step, {"w": md}, frozenset(), {}, 24, gen)

    assert check_served([meta(0), meta(1)], (0, 1), 5, 3) == ""
    assert "generation 4 rank 0 step 5, not generation 3" in check_served([meta(0, gen=4), meta(1)], (0, 1), 5, 3)
    assert "step 0, not" in check_served([meta(0), meta(1, step=0)], (0, 1), 5, 3)
    assert "do not cover" in check_served([meta(0)], (0,), 5, 3)


def test_served_pipeline_snapshots_must_cover_every_stage() -> None:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    from elastictrain.checkpoint.memory_dcp import SnapshotMeta
    from elastictrain.controller.sources import check_served

    def meta(rank: int) -> SnapshotMeta:  # pp2 x dp1: each rank holds its stage's whole block
        md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2]),
                                   [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))])
        return SnapshotMeta(rank, 5, {f"blocks.{rank}.w": md}, frozenset(), {}, 8, 3, coord={"pp": rank}, sizes={"pp": 2})

    assert check_served([meta(0), meta(1)], (0, 1), 5, 3) == ""
    assert "stage(s) [1]" in check_served([meta(0)], (0,), 5, 3)


def test_gatherer_reads_a_pipeline_by_stage(ray_local, tmp_path) -> None:
    """The gatherer describes the failed generation's mesh with its pp factor: under pp2 a survivor of
    stage 0 alone is no source (the old one-shard rule broadcast its stage as the whole state), and under
    pp2 x dp2 one survivor per stage serves its snapshot (never the replicated broadcast)."""
    import ray

    from elastictrain import build_config
    from elastictrain.checkpoint.memory_dcp import SnapshotMeta
    from elastictrain.controller.gather import PeerRestore, Previous, SourceGatherer
    from elastictrain.controller.group import Slot, SlotState
    from elastictrain.events import EventLog
    from elastictrain.parallel.layout import Layout, MeshDims
    from tests.conftest import job

    @ray.remote(num_cpus=0)
    class Survivor:  # one actor answers for every survivor slot (a meta names its rank; one process to start)
        def use(self, d: int) -> None:
            self.d = d

        def own_snapshots(self) -> list:
            return []

        def hold_snapshot(self, expect):
            gen, rank, step = expect
            return SnapshotMeta(rank, step, {}, frozenset(), {}, 0, gen, coord={"pp": rank // self.d}, sizes={"pp": 2})

    actor = Survivor.remote()

    def gathered(d: int, alive_ranks: list[int]):
        ray.get(actor.use.remote(d))
        layout = Layout(MeshDims(pp=2, dp_replicate=d, plan="ddp"), 1, "pp2")
        g = SourceGatherer(build_config(job()), EventLog(tmp_path, console=None), None, None, None, None,
                           lambda world: layout)
        slots = [Slot(r, actor=actor, state=SlotState.MEMBER, info={"step": 5}, rank=r) for r in alive_ranks]
        prev = Previous(1, {r: r for r in alive_ranks}, 2 * d)
        return g.gather(slots, slots, prev, 2, [5])

    alone = gathered(1, [0])  # pp2: stage 1's only rank died
    assert alone.kind != "peer" and "[(1, 0)]" in alone.reason
    replica = gathered(2, [0, 2, 3])  # pp2 x dp2: rank 1 (stage 0) died, rank 0 holds stage 0
    assert replica.kind == "peer" and isinstance(replica.resume, PeerRestore)
    assert [(s.meta.rank, s.meta.at("pp")) for s in replica.resume.sources] == [(0, 0), (2, 1)]


def test_tensor_parallel_peer_needs_every_tp_coordinate() -> None:
    # tp2 x dp2 (ddp): ranks 0,1 are replica 0 (tp coordinates 0,1), ranks 2,3 replica 1; rank 1 died:
    # the data-parallel replica of its (pp, tp) coordinate, rank 3, serves it
    replica = rank_sources(tp=2, dp_replicate=2, dp_shard=1, survivors={0: 7, 2: 7, 3: 7}, memory={},
                           durable_step=None, last_step=7)
    assert replica.chosen.kind == "peer" and replica.chosen.ranks == (0, 3) and replica.lost_steps == 0
    assert "every tp coordinate's every shard" in replica.reason
    # both holders of tp coordinate 1 died: the peer memory tier, named why
    gone = rank_sources(tp=2, dp_replicate=2, dp_shard=1, survivors={0: 7, 2: 7}, memory={7: True},
                        durable_step=4, last_step=7)
    assert gone.chosen.kind == "memory" and gone.lost_steps == 0
    assert "lack (tp coordinate, shard coordinate) [(1, 0)] of 2 x 1 (mesh dp_replicate=2 x dp_shard=1 x tp=2)" \
        in gone.reason
    # tp2 alone: the lost rank's shard is nowhere else live; the tier, else durable
    alone = rank_sources(tp=2, dp_replicate=1, dp_shard=1, survivors={1: 9}, memory={}, durable_step=6, last_step=9)
    assert alone.chosen.kind == "checkpoint" and alone.lost_steps == 3 and "[(0, 0)]" in alone.reason
    # tp2 x pp2 x fsdp2 (world 8): stage p, shard j, tp t is rank 4p + 2j + t; one of each
    full = rank_sources(pp=2, tp=2, dp_replicate=1, dp_shard=2, survivors={r: 3 for r in range(8) if r != 6},
                        memory={}, durable_step=None, last_step=3)
    assert full.chosen.kind == "scratch"
    assert "lack (pipeline stage, tp coordinate, shard coordinate) [(1, 0, 1)] of 2 x 2 x 2" in full.reason
    with pytest.raises(ValueError, match="tp=0"):
        rank_sources(tp=0, dp_replicate=1, dp_shard=1, survivors={}, memory={}, durable_step=None, last_step=0)


@settings(max_examples=300, deadline=None)
@given(mesh=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 4)), data=st.data())
def test_tp_peer_is_viable_exactly_when_every_coordinate_is_covered(mesh, data) -> None:
    pp, rep, shard, tp = mesh
    d_size = rep * shard
    world = pp * d_size * tp
    alive = data.draw(st.sets(st.integers(0, world - 1)))
    d = rank_sources(pp=pp, tp=tp, dp_replicate=rep, dp_shard=shard, survivors={r: 4 for r in alive}, memory={},
                     durable_step=None, last_step=4)

    def coord(r: int) -> tuple[int, int, int]:  # the design's row-major (pp, dp_replicate, dp_shard, tp)
        return r // (d_size * tp), r % tp, (r // tp) % shard

    every = {(p, t, j) for p in range(pp) for t in range(tp) for j in range(shard)}
    assert (d.chosen.kind == "peer") == ({coord(r) for r in alive} == every)
    if d.chosen.kind == "peer":
        assert sorted(coord(r) for r in d.chosen.ranks) == sorted(every)
    elif alive:
        assert "lack" in d.reason
