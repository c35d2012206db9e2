"""ddp x ep built on meta (issue 36, the share rule under expert parallel): no rank of an ep2 group ever
materializes the experts it does not hold -- at the start (``parallel.meta_init``), at a rebuild for a new
membership generation, nor while loading a durable checkpoint -- and it trains the numbers of the whole build.

Two real gloo processes drive the worker's step loop (``StepRunner``) directly. The share is measured two
ways on each rank: a walk of the parameters it holds once built (exactly the dense part plus 1/ep of the
experts), and its resident-set high-water (``VmHWM``, reset through ``/proc/self/clear_refs``) over the
build, which sees what was allocated and freed in between (a whole expert tensor made and sliced). The
model's experts are most of it, so holding them all shows far above the bound.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
from typing import Any

import pytest
import torch

from elastictrain import build_config
from elastictrain.parallel.init import init_by_name
from tests.checkpoint_fixtures import free_port
from tests.conftest import job
from tests.ranks import run_ranks

# GPT with an MoE feed-forward in both blocks: 8 experts of 384 -> 1536 -> 384 (4.7 MB each), ~77 MB of
# experts against ~4 MB of dense parameters
BIG = {"seq_len": 16, "n_layer": 2, "n_head": 4, "d_model": 384, "dropout": 0.0, "moe": {"experts": 8, "top_k": 2}}
SMALL = {"seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32, "dropout": 0.0, "moe": {"experts": 4, "top_k": 2}}
MIB = 2 ** 20


def _config(model: dict[str, Any], steps: int, **parallel: Any) -> Any:
    return build_config(job(task={"model": model, "optimizer": {"lr": 3e-3}},
                            train={"steps": steps, "global_batch": 8, "micro_batch": 2},
                            workers={"min": 2, "max": 2}, parallel={"plan": "ddp", "ep": 2, **parallel}))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class _HighWater:
    """The growth of this process's resident set over a ``with`` block, at its high-water mark (bytes)."""

    def __enter__(self) -> _HighWater:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (Linux >= 4.0)
        self.before = _status_kb("VmRSS")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.grown = (_status_kb("VmHWM") - self.before) * 1024


def _held_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameters this rank holds: expert tensors (their local slice) and the rest."""
    from torch.distributed.tensor import DTensor

    from elastictrain.models.moe import moe_layers

    experts = {id(getattr(m, n)) for m in moe_layers(model).values() for n in m.expert_names}
    held = {"experts": 0, "dense": 0}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        held["experts" if id(p) in experts else "dense"] += local.numel() * local.element_size()
    return held


def _ranks(rank: int, runs: list[dict[str, Any]], port: int, out: str, ckpt: str) -> None:
    """Per run: the start's growth and held bytes, every step's loss, the whole model after the steps; with
    ``rebuild_at``: after that many steps a DCP checkpoint is written, the runner is released and attached
    again (generation 1: a rebuild) and loads it (the growth and held bytes of that rebuild and load too)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    # every tensor above 64 KiB its own mapping, returned at free: one run's freed memory hides no growth
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    results = []
    try:
        for i, run in enumerate(runs):
            cfg = _config(run["model"], max(run["steps"], 1), **run["parallel"])
            layout = resolve(spec_from_config(cfg), 2)
            with _HighWater() as start:
                runner = StepRunner(builtin_task(cfg), cfg.train, FaultInjector(()), parallel=cfg.parallel)
                runner.attach(rank, 2, 0, layout)
                if runner.uninitialized:
                    runner.init_from_seed()
            result = {"start": start.grown, "held": _held_bytes(runner.model), "losses": []}
            for step in range(run["steps"]):
                if step == run.get("rebuild_at"):
                    path = os.path.join(ckpt, str(i))
                    dcp.save(runner.state.state_dict(), checkpoint_id=path)
                    runner.release()
                    gc.collect()  # (the released model and optimizer: freed before the measure starts)
                    with _HighWater() as rebuild:
                        runner.attach(rank, 2, 1, layout)
                    with _HighWater() as load:
                        runner.state.load_from(dcp.FileSystemReader(path))
                    runner.uninitialized = False  # (what the worker's restore_from sets)
                    result.update(rebuild=rebuild.grown, load=load.grown, rebuilt_held=_held_bytes(runner.model))
                result["losses"].append(runner.run_step(False)[0].loss)
            result["params"] = runner.state.full_model_state() if run["steps"] else {}
            results.append(result)
            del runner
            gc.collect()  # (reference cycles: the next run's measure starts with this one freed)
        gathered: list[Any] = [None, None]
        keys = ("start", "rebuild", "load", "held")
        dist.all_gather_object(gathered, [{k: r[k] for k in keys if k in r} for r in results])
        if rank == 0:
            for i, r in enumerate(results):
                r["ranks"] = [g[i] for g in gathered]
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _run(tmp_path, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = str(tmp_path / "out.pt")
    run_ranks(_ranks, (runs, free_port(), out, str(tmp_path / "ckpt")), nprocs=2)
    return torch.load(out)


def _whole_bytes(model: dict[str, Any]) -> dict[str, int]:
    from elastictrain.models.gpt import GPT, GPTConfig
    from elastictrain.models.moe import MoEConfig

    with torch.device("meta"):
        return _held_bytes(GPT(GPTConfig(vocab_size=256, **{**model, "moe": MoEConfig(**model["moe"])})))


def test_an_expert_s_initial_values_depend_on_seed_layer_and_index_only() -> None:
    """init_by_name seeds each expert on its own: experts 0-3 of an 8-expert layer equal those of a
    4-expert one (so a rank holding experts 4-7 builds no others), and two experts differ. Against the
    whole-layer draw (one normal_ over ``[E, ...]``): w_out's experts differ between the two models."""
    from elastictrain.models.gpt import GPT, GPTConfig
    from elastictrain.models.moe import MoEConfig

    def built(experts: int) -> GPT:
        model = GPT(GPTConfig(vocab_size=64, **{**SMALL, "moe": MoEConfig(experts=experts, top_k=2)}))
        init_by_name(model, model, 7)
        return model

    four, eight = built(4).blocks[1].moe, built(8).blocks[1].moe
    for name in four.expert_names:
        assert torch.equal(getattr(four, name), getattr(eight, name)[:4]), name
    assert not torch.equal(eight.w_out[4], eight.w_out[5]) and torch.equal(eight.b_out, torch.zeros_like(eight.b_out))


def test_meta_init_is_allowed_under_ddp_with_ep() -> None:
    assert _config(SMALL, 1, meta_init=True).parallel.meta_init


def test_ddp_ep2_meta_build_trains_the_numbers_of_the_whole_build(tmp_path) -> None:
    """ep2 under ddp from a meta build (the start), and rebuilt on meta after step 2 (a new generation)
    loading a durable checkpoint: every step's loss and the final parameters equal those of the whole
    build run through without a rebuild. Against a build seeding each rank's experts by their local index
    (rank 1's experts 2-3 given experts 0-1's values): step 1's loss differs (5.57576 against 5.57500)."""
    runs = _run(tmp_path, [{"model": SMALL, "steps": 4, "parallel": {"meta_init": True}, "rebuild_at": 2},
                           {"model": SMALL, "steps": 4, "parallel": {}}])
    meta, whole = runs
    assert meta["losses"] == whole["losses"]
    assert meta["params"].keys() == whole["params"].keys()
    for k in whole["params"]:
        assert torch.equal(meta["params"][k], whole["params"][k]), k


@pytest.mark.slow
def test_ddp_ep2_rank_holds_the_dense_part_and_half_the_experts(tmp_path) -> None:
    """Each ep2 rank holds exactly the dense part and half the experts once built, at the start and after a
    rebuild (generation 1), and its resident set grows by at most that, plus DDP's gradient bucket (the dense
    part again), two experts' worth of scratch (one layer's expert at a time is initialised) and 8 MiB of
    runtime, while it builds (the start with its step-0 values, the rebuild), and by
    at most the state's 16 bytes per held parameter plus the same slack while it loads the checkpoint. A tiny
    run first takes the process's one-time costs. The whole build (meta_init off: the start of every
    ddp x ep run before) grows by more than the whole model: the measure sees it (seen: start 51 MiB, rebuild
    0.1 MiB -- memory is counted where written: the load writes it --, load 174 MiB, whole start 117 MiB;
    bounds 64 and 185 MiB). Against broken builds: the rebuild built whole (the former ddp x ep rule):
    rebuild 87 MiB > 64; the experts initialised a whole layer at a time: start 89 MiB > 64."""
    whole = _whole_bytes(BIG)
    share = whole["dense"] + whole["experts"] // 2
    slack = whole["dense"] + whole["experts"] // 8 + 8 * MIB
    _, meta, full = _run(tmp_path, [{"model": SMALL, "steps": 0, "parallel": {"meta_init": True}},
                                    {"model": BIG, "steps": 1, "parallel": {"meta_init": True}, "rebuild_at": 0},
                                    {"model": BIG, "steps": 0, "parallel": {}}])
    for r in meta["ranks"]:
        assert r["held"] == {"dense": whole["dense"], "experts": whole["experts"] // 2}, (r["held"], whole)
        assert r["start"] <= share + slack, (r["start"] / MIB, (share + slack) / MIB)
        assert r["rebuild"] <= share + slack, (r["rebuild"] / MIB, (share + slack) / MIB)
        assert r["load"] <= 4 * share + slack, (r["load"] / MIB, (4 * share + slack) / MIB)
    assert meta["rebuilt_held"] == meta["held"]
    assert min(r["start"] for r in full["ranks"]) > sum(whole.values()), (full["ranks"], whole)
