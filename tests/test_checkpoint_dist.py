"""Real 2-rank gloo process groups (spawned processes on 127.0.0.1): async save, commit, reshard on load,
the busy/skip agreement, and a peer dying mid-save."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import free_port, fresh, init_gloo, same_state, trained

from elastictrain.checkpoint import CheckpointStore, CheckpointWriter, app_state, apply_app_state, load_checkpoint
from elastictrain.config import CheckpointConfig
from tests import ranks


def _save_scenario(rank: int, world: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = init_gloo(rank, world, port)
    model, opt = trained(seed=0)
    ddp = DDP(model)
    writer = CheckpointWriter(CheckpointConfig(max_in_flight=1, when_busy="skip"), root, rank, world, group)
    started = [writer.save_async(2, app_state(ddp, opt))]
    with torch.no_grad():  # staging copied: mutating right away must not leak into the checkpoint
        for p in model.parameters():
            p.add_(1000.0)
    reports = writer.wait(60)
    if rank == 1:
        writer._slots.acquire()  # pretend rank 1 is still busy with an older save
    started.append(writer.save_async(3, app_state(ddp, opt)))
    reports += writer.wait(60)
    if rank == 1:
        writer._slots.release()
    started.append(writer.save_async(4, app_state(ddp, opt)))
    reports += writer.wait(60)
    writer.close()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps((started, reports)))
    dist.destroy_process_group()


def _load_scenario(rank: int, world: int, port: int, manifest_blob: bytes, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = init_gloo(rank, world, port)
    manifest = pickle.loads(manifest_blob)
    model, opt = fresh()
    ddp = DDP(model)
    state = app_state(ddp, opt)
    load_checkpoint(manifest, None, state, process_group=group)
    apply_app_state(ddp, opt, state)
    ok = same_state((model, opt), trained(seed=0))
    Path(out, f"load{rank}.txt").write_text(str(ok))
    dist.destroy_process_group()


def _death_scenario(rank: int, world: int, port: int, root: str, out: str) -> None:
    # init_gloo's bound (5 s here timed out a rendezvous whose peer's imports ran 8 s late): the peer's death
    # fails the save's collective at once, not at the timeout
    group = init_gloo(rank, world, port)
    model, opt = trained(seed=0, steps=1)
    if rank == 1:
        # The peer vanishes during the save, once its own shard file is on disk (so the save has passed
        # its planning collectives) and before it reports its write: rank 0, waiting in the save's last
        # collective, must get an error. (Watching for the file from another thread raced the tiny write.)
        from elastictrain.checkpoint import dcp_io

        write_data = dcp_io.HashingWriter.write_data

        def write_then_die(self, plan, planner):  # type: ignore[no-untyped-def]
            write_data(self, plan, planner).wait()
            os._exit(3)

        dcp_io.HashingWriter.write_data = write_then_die
    writer = CheckpointWriter(CheckpointConfig(), root, rank, world, group, close_timeout_s=20)
    writer.save_async(7, app_state(model, opt))
    reports = writer.wait(60)  # returns the report only if the save ended (with an error), not if it hangs
    writer.close()
    Path(out, "death.pkl").write_bytes(pickle.dumps(reports))
    os._exit(0)  # destroying a group with a dead peer could block; the test only needs the report


def _spawn(fn, *args, world: int = 2, timeout: float = 60.0) -> list[int]:
    ctx = ranks.context()
    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
        codes.append(p.exitcode)
    return codes


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[CheckpointStore, dict]:
    base = tmp_path_factory.mktemp("dist")
    root = str(base / "run")
    assert _spawn(_save_scenario, root, str(base)) == [0, 0]
    results = {r: pickle.loads((base / f"rank{r}.pkl").read_bytes()) for r in range(2)}
    return CheckpointStore(root), results


def test_two_rank_save_commit_and_reshard_into_one_rank(saved: tuple[CheckpointStore, dict]) -> None:
    store, results = saved
    reports = [rep for r in range(2) for rep in results[r][1]]
    by_step = {}
    for rep in reports:
        by_step.setdefault(rep.step, []).append(rep)
    ok2 = [r for r in by_step[2] if r.error is None]
    assert len(ok2) == 2, by_step[2]
    assert ".metadata" in next(r for r in ok2 if r.rank == 0).files
    assert all(any(p.endswith(".distcp") for p in r.files) for r in ok2)  # each rank wrote its own file
    manifest = store.commit(2, ok2, {"world_size": 2, "samples_seen": 32, "plan": "ddp"})
    assert store.verify(manifest) == []
    # N=2 -> M=1: load in this (non-distributed) process into a fresh model and a fresh Adam
    model, opt = fresh()
    state = app_state(model, opt)
    load_checkpoint(manifest, store.root_uri, state)
    apply_app_state(model, opt, state)
    assert same_state((model, opt), trained(seed=0))


def test_skip_agreement_abandons_step_on_every_rank(saved: tuple[CheckpointStore, dict]) -> None:
    _, results = saved
    assert results[0][0] == [True, True, True]
    assert results[1][0] == [True, False, True]
    step3 = {r: [rep for rep in results[r][1] if rep.step == 3] for r in range(2)}
    assert "skipped" in step3[1][0].error
    assert "abandoned" in step3[0][0].error  # rank 0 staged, but must not write a half checkpoint
    step4 = [rep for r in range(2) for rep in results[r][1] if rep.step == 4]
    assert [rep.error for rep in step4] == [None, None]


def test_load_into_two_ranks(saved: tuple[CheckpointStore, dict], tmp_path: Path) -> None:
    store, results = saved
    manifest = next((m for m in store.committed() if m.step == 2), None)
    if manifest is None:
        reports = [rep for r in range(2) for rep in results[r][1] if rep.step == 2]
        manifest = store.commit(2, reports, {"world_size": 2})
    assert _spawn(_load_scenario, pickle.dumps(manifest), str(tmp_path)) == [0, 0]
    assert [(tmp_path / f"load{r}.txt").read_text() for r in range(2)] == ["True", "True"]


def test_peer_death_mid_save_reports_error_and_never_commits(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    codes = _spawn(_death_scenario, root, str(tmp_path), timeout=180)
    assert codes[1] == 3
    reports = pickle.loads((tmp_path / "death.pkl").read_bytes())
    assert len(reports) == 1 and reports[0].error, reports
    assert list(Path(root).rglob("__1_*.distcp"))  # the fault landed during the save: rank 1 had written
    store = CheckpointStore(root)
    assert store.committed() == []
    from elastictrain.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="rank 0"):
        store.commit(7, reports, {"world_size": 2})
