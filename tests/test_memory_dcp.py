"""Per-rank host snapshots of sharded state and the DCP reader over a set of them: real gloo process
groups in real processes, real FSDP2 ``fully_shard``, resharded to other world sizes and to a plain module."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from elastictrain.checkpoint.memory_dcp import Coverage, SnapshotReader, coverage, take_snapshot
from tests.checkpoint_fixtures import free_port
from tests.ranks import run_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # odd sizes: FSDP's dim-0 shards are uneven and one rank's may be empty
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3, bias=True))


def _build(world: int, sharded: bool):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": m, "optim": o}


def _worker(rank: int, world: int, port: int, job: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, optim = _build(world, sharded=job != "plain")
        if job == "save":
            torch.manual_seed(1)
            for _ in range(3):  # real training steps: the optimizer state is non-trivial
                model(torch.randn(5, 6)).pow(2).sum().backward()
                optim.step()
                optim.zero_grad()
            m, o = get_state_dict(model, optim)
            snap = take_snapshot({"model": m, "optim": o, "progress": {"step": 3, "cursor": 48}}, rank=rank, step=3)
            # the meta's compact pickled form (it travels to every joining rank) gives back the same meta
            assert pickle.loads(pickle.dumps(snap.meta)) == snap.meta
            full = _full(model, optim)  # collective
            Path(out, f"snap{rank}.pkl").write_bytes(pickle.dumps(snap))
            if rank == 0:
                torch.save(full, Path(out, "full.pt"))
            return
        snaps = [pickle.loads(p.read_bytes()) for p in sorted(Path(out).glob("snap*.pkl"))]
        m, o = get_state_dict(model, optim)
        state = {"model": m, "optim": o, "progress": {"step": 0, "cursor": 0}}
        dcp.load(state, storage_reader=SnapshotReader(snaps), process_group=dist.group.WORLD)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        full = _full(model, optim)
        if rank == 0:
            torch.save({"full": full, "progress": state["progress"]}, Path(out, f"loaded_{job}_{world}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, job: str, out: Path) -> None:
    run_ranks(_worker, (world, free_port(), job, str(out)), world)


def _flat(tree) -> dict:
    from torch.utils._pytree import tree_flatten_with_path, keystr

    leaves, _ = tree_flatten_with_path(tree)
    return {keystr(p): v for p, v in leaves}


def _assert_bitwise(a, b) -> None:
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    # two empty states are equal too: the model's weights and the optimizer's moments must be there
    assert sum(isinstance(v, torch.Tensor) and v.numel() > 0 for v in fa.values()) >= 4, sorted(fa)
    for k in fa:
        if isinstance(fa[k], torch.Tensor):
            assert fa[k].dtype == fb[k].dtype and torch.equal(fa[k], fb[k]), k
        else:
            assert fa[k] == fb[k], k


def test_fsdp_snapshots_reshard_into_any_world_size_bitwise(tmp_path: Path) -> None:
    _spawn(4, "save", tmp_path)
    original = torch.load(tmp_path / "full.pt", weights_only=False)
    # Rank 3 is lost with its own copy; the peer tier holds its snapshot (a pickled copy made elsewhere).
    lost = tmp_path / "snap3.pkl"
    peer_copy = lost.read_bytes()
    lost.unlink()
    metas = [pickle.loads(p.read_bytes()).meta for p in sorted(tmp_path.glob("snap*.pkl"))]
    cov = coverage(metas)
    assert not cov.complete and "model.0.weight" in cov.reason  # dim-0 shards: rank 3 held rows 6..7
    lost.write_bytes(peer_copy)
    assert coverage([pickle.loads(p.read_bytes()).meta for p in sorted(tmp_path.glob("snap*.pkl"))]).complete
    for world, job in ((2, "fsdp"), (3, "fsdp"), (1, "plain")):
        _spawn(world, job, tmp_path)
        got = torch.load(tmp_path / f"loaded_{job}_{world}.pt", weights_only=False)
        _assert_bitwise(got["full"], original)
        assert got["progress"] == {"step": 3, "cursor": 48}


def test_coverage_is_exact_on_partial_overlaps_and_scalars() -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as C, TensorProperties as P
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as T

    from elastictrain.checkpoint.memory_dcp import SnapshotMeta

    def meta(rank, step, chunks, size=(4, 4), objects=()):
        return SnapshotMeta(rank, step, {"w": T(P(), torch.Size(size), [C(torch.Size(o), torch.Size(s)) for o, s in chunks])},
                            frozenset(objects), {}, 0)

    quarter = meta(0, 5, [((0, 0), (2, 4)), ((2, 0), (2, 2))])
    assert coverage([quarter]).missing == ("w: offsets [2, 2] sizes [2, 2] of [4, 4]",)
    assert coverage([quarter, meta(1, 5, [((1, 1), (3, 3))])]).complete  # overlapping chunks still cover
    mixed = coverage([quarter, meta(1, 6, [((2, 2), (2, 2))])])
    assert not mixed.complete and "different (generation, step)" in mixed.reason
    assert coverage([meta(0, 1, [((), ())], size=())]).complete  # a 0-d tensor (Adam's step)
    assert coverage([meta(0, 1, [((0,), (0,))], size=(0,))]).complete  # an empty tensor
    assert not coverage([meta(0, 1, [((0, 0), (4, 4))])], expected={"progress.step"}).complete
    assert coverage([], ()) == Coverage(False, ("no snapshot",))
    with pytest.raises(ValueError, match="incomplete"):
        SnapshotReader([type("S", (), {"meta": quarter, "fetch": None})()])


def test_coverage_needs_every_pipeline_stage_of_one_pipeline_size() -> None:
    """A stage's snapshot names its own stage's entries only: without the pp coordinate, two stage-0
    snapshots (replicas) of a pp2 layout looked like a whole state."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as C, TensorProperties as P
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as T

    from elastictrain.checkpoint.memory_dcp import SnapshotMeta

    def meta(rank, pp_rank, pp_size=2, rows=((0, 4),)):
        chunks = [C(torch.Size([o, 0]), torch.Size([n, 2])) for o, n in rows]
        tensors = {f"blocks.{pp_rank}.w": T(P(), torch.Size([4, 2]), chunks),
                   "progress.step": T(P(), torch.Size([]), [C(torch.Size([]), torch.Size([]))])}
        return SnapshotMeta(rank, 5, tensors, frozenset(), {}, 0, 1, coord={"pp": pp_rank}, sizes={"pp": pp_size})

    replicas = coverage([meta(0, 0), meta(1, 0)])  # pp2 x dp2: both replicas of stage 0, none of stage 1
    assert not replicas.complete and replicas.missing == ("no snapshot of pipeline stage(s) [1] of pp_size 2",)
    assert coverage([meta(0, 0), meta(2, 1)]).complete
    # stage 1 sharded (fsdp 2 within the stage): one of its halves is gone
    half = coverage([meta(0, 0), meta(2, 1, rows=((0, 2),))])
    assert half.missing == ("blocks.1.w (stage 1): offsets [2, 0] sizes [2, 2] of [4, 2]",)
    assert coverage([meta(0, 0), meta(2, 1, rows=((0, 2),)), meta(3, 1, rows=((2, 2),))]).complete
    mixed = coverage([meta(0, 0), meta(1, 1), meta(2, 2, pp_size=4), meta(3, 3, pp_size=4)])
    assert not mixed.complete and "pipeline sizes (pp_size [2, 4])" in mixed.reason
    assert "outside their pipeline" in coverage([meta(0, 0, pp_size=1), meta(1, 1, pp_size=1)]).reason
    assert coverage([meta(0, 0, pp_size=1)]).complete  # no pipeline: as before
    # the coordinate travels in the meta's compact pickled form
    back = pickle.loads(pickle.dumps(meta(3, 1)))
    assert (back.at("pp"), back.size("pp")) == (1, 2) and back == meta(3, 1)


def test_stage_snapshots_load_by_name_into_another_pipeline_split() -> None:
    """Snapshots of two stages (modules holding the full model's names, as the pipeline split keeps them)
    load by name into the unsplit model, and a whole model's snapshot loads into each stage: a change of P
    between generations reloads each rank's new stage from the same snapshots."""
    import torch.distributed.checkpoint as dcp

    from elastictrain.checkpoint.memory_dcp import take_snapshot

    torch.manual_seed(0)
    full = torch.nn.ModuleDict({str(i): torch.nn.Linear(3, 3) for i in range(4)})

    def stage(keep):  # a stage keeps the blocks it owns under their original keys
        return torch.nn.ModuleDict({k: m for k, m in full.items() if k in keep})

    snaps = [take_snapshot({"model": stage(keep).state_dict()}, rank=p, step=2, coord={"pp": p}, sizes={"pp": 2})
             for p, keep in enumerate((("0", "1"), ("2", "3")))]
    assert [(s.meta.at("pp"), s.meta.size("pp")) for s in snaps] == [(0, 2), (1, 2)]
    assert coverage([s.meta for s in snaps]).complete and not coverage([snaps[1].meta]).complete
    fresh = torch.nn.ModuleDict({str(i): torch.nn.Linear(3, 3) for i in range(4)})
    target = {"model": fresh.state_dict()}
    dcp.load(target, storage_reader=SnapshotReader([_Held(s) for s in snaps]), no_dist=True)
    for k, v in full.state_dict().items():
        assert torch.equal(target["model"][k], v), k
    whole = take_snapshot({"model": full.state_dict()}, rank=0, step=2)
    for keep in (("0",), ("1", "2"), ("3",)):  # pp4-ish or uneven splits: each loads its own names
        mine = {"model": torch.nn.ModuleDict({k: torch.nn.Linear(3, 3) for k in keep}).state_dict()}
        dcp.load(mine, storage_reader=SnapshotReader([_Held(whole)]), no_dist=True)
        assert all(torch.equal(v, full.state_dict()[k]) for k, v in mine["model"].items())


def test_packed_chunks_come_back_bitwise_as_views_of_one_buffer() -> None:
    from elastictrain.checkpoint.memory_dcp import Packed, pack, unpack

    torch.manual_seed(0)
    chunks = {
        ("w", (0, 0)): torch.randn(3, 5),
        ("w", (3, 0)): torch.randn(5, 3).t(),  # not contiguous
        ("half", (0,)): torch.randn(7).to(torch.bfloat16),  # 14 bytes: the next chunk starts aligned anyway
        ("step", ()): torch.tensor(12, dtype=torch.int64),
        ("mask", (0,)): torch.tensor([True, False, True]),
        ("empty", (0,)): torch.empty(0, 4),
        ("progress", None): b"\x80\x04pickled",
    }
    packed = pickle.loads(pickle.dumps(pack(chunks)))  # as it travels between processes
    assert isinstance(packed, Packed) and packed.buffer.dtype == torch.uint8
    got = unpack(packed)
    assert got.keys() == chunks.keys() and got[("progress", None)] == chunks[("progress", None)]
    base = packed.buffer.untyped_storage().data_ptr()
    for k, v in chunks.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
            assert got[k].untyped_storage().data_ptr() == base, f"{k}: a copy, not a view of the buffer"


class _Held:
    """A snapshot as a local SnapshotSource."""

    def __init__(self, snap) -> None:
        self.snap, self.meta = snap, snap.meta

    def fetch(self, keys):
        return self.snap.fetch(keys)

    def start_fetch(self, keys):
        got = self.snap.fetch(keys)
        return lambda: got


def test_load_writes_into_the_live_state_and_restores_hyperparameters_or_falls_back(monkeypatch) -> None:
    """``TrainingState.load_from`` loads in place where the state dict aliases the live tensors (checked),
    puts the optimizer's hyperparameters back, and takes ``set_state_dict`` where it does not alias."""
    import elastictrain.parallel.train_state as ts
    from elastictrain.data.cursor import CursorState

    def trained(steps: int, lr: float):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        for _ in range(steps):
            model(torch.ones(2, 6)).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return ts.TrainingState(model, opt, CursorState(0, 8, 0, 100), step=steps)

    src = trained(3, lr=1e-2)
    snap = take_snapshot(src.state_dict(), rank=0, step=3)
    expected = _flat(_full(src.model, src.optimizer))
    for aliased in (True, False):
        dst = trained(0, lr=5e-1)
        assert ts.aliases_live_state(dst.state_dict(), dst.model, dst.optimizer)
        assert not ts.aliases_live_state({"model": {k: v.clone() for k, v in dst.model.state_dict().items()},
                                          "optim": dst.state_dict()["optim"]}, dst.model, dst.optimizer)
        called = []
        real = ts.load_model_optim_state
        monkeypatch.setattr(ts, "load_model_optim_state", lambda *a: (called.append(1), real(*a)))
        if not aliased:
            monkeypatch.setattr(ts, "aliases_live_state", lambda *a: False)
        assert dst.load_from(SnapshotReader([_Held(snap)])) == 3 and dst.step == 3
        assert bool(called) is not aliased  # set_state_dict only where the tensors were not loaded in place
        assert dst.optimizer.param_groups[0]["lr"] == 1e-2  # the snapshot's hyperparameters, not the live ones
        _assert_bitwise(_flat(_full(dst.model, dst.optimizer)), expected)
        monkeypatch.undo()


def test_sources_of_one_keeper_are_asked_in_one_call_and_answered_in_order() -> None:
    from elastictrain.checkpoint.memory_dcp import start_fetches

    calls: list[list[str]] = []

    class Kept:
        def __init__(self, name: str, keeper: str | None) -> None:
            self.name, self.batch_key = name, keeper

        def start_fetch(self, keys):
            calls.append([self.name])
            return lambda: {k: self.name for k in keys}

        @staticmethod
        def start_fetch_batch(requests):
            calls.append([s.name for s, _ in requests])
            return [(lambda s=s, keys=keys: {k: s.name for k in keys}) for s, keys in requests]

    srcs = [Kept("a", "k1"), Kept("b", None), Kept("c", "k1"), Kept("d", "k2"), Kept("e", "k1")]
    waits = start_fetches([(s, {("x", (i,))}) for i, s in enumerate(srcs)])
    assert sorted(calls) == [["a", "c", "e"], ["b"], ["d"]]  # one call for keeper k1's three snapshots
    assert [w() for w in waits] == [{("x", (i,)): s.name} for i, s in enumerate(srcs)]


def test_coverage_needs_every_tp_coordinate_of_each_stage() -> None:
    """Under tensor parallel a rank holds one column (or row) shard of each TP parameter, with global
    offsets, and a whole copy of the replicated ones (norms). A set lacking a tp coordinate is named, on
    top of the holes its shards leave; tp sizes never mix."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as C, TensorProperties as P
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as T

    from elastictrain.checkpoint.memory_dcp import SnapshotMeta

    def meta(rank, tp_rank, tp_size=2, pp_rank=0, pp_size=1):
        cols = 4 // tp_size  # the column-wise shard of w (4 x 4) this tp coordinate holds
        tensors = {f"s{pp_rank}.w": T(P(), torch.Size([4, 4]), [C(torch.Size([0, tp_rank * cols]),
                                                                   torch.Size([4, cols]))]),
                   f"s{pp_rank}.norm": T(P(), torch.Size([4]), [C(torch.Size([0]), torch.Size([4]))])}
        return SnapshotMeta(rank, 5, tensors, frozenset(), {}, 0, 1, coord={"pp": pp_rank, "tp": tp_rank},
                            sizes={"pp": pp_size, "tp": tp_size})

    # tp2 x dp2: ranks 0,1 are replica 0's tp coordinates 0,1; ranks 2,3 replica 1's
    assert coverage([meta(0, 0), meta(3, 1)]).complete  # a replica of each tp coordinate
    lost = coverage([meta(0, 0), meta(2, 0)])  # both holders of tp coordinate 1 gone
    assert lost.missing == ("no snapshot of tp coordinate(s) [1] of tp_size 2",
                            "s0.w: offsets [0, 2] sizes [4, 2] of [4, 4]")
    mixed = coverage([meta(0, 0), meta(1, 1), meta(2, 0, tp_size=1)])
    assert not mixed.complete and "tensor-parallel sizes (tp_size [1, 2])" in mixed.reason
    assert "outside their group" in coverage([meta(0, 0), meta(1, 2)]).reason
    # tp2 x pp2: each stage needs both tp coordinates
    stages = [meta(0, 0, pp_rank=0, pp_size=2), meta(1, 1, pp_rank=0, pp_size=2), meta(2, 0, pp_rank=1, pp_size=2)]
    assert coverage(stages).missing == ("no snapshot of tp coordinate(s) [1] of pipeline stage 1 of tp_size 2",
                                        "s1.w (stage 1): offsets [0, 2] sizes [4, 2] of [4, 4]")
    assert coverage([*stages, meta(3, 1, pp_rank=1, pp_size=2)]).complete
    back = pickle.loads(pickle.dumps(meta(3, 1)))
    assert (back.at("tp"), back.size("tp")) == (1, 2) and back == meta(3, 1)
