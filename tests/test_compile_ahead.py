"""A standby compiles ahead (``parallel.compile``, issue 38): :meth:`StepRunner.compile_ahead` in the set-up
ahead, then the take (``attach`` and the steps) on the model compiled there.

One fresh process (world size 1 over gloo: the property is per process, and inductor's first compile costs
~20 s of CPU on this machine, so one compile for the whole file): an eager run, then a standby's runner
that compiles ahead and is taken under ddp. The take must compile nothing (no graph traced by dynamo, none
compiled or fetched by inductor: the blocks and the loss the replacement trains are the ones compiled
ahead, and nothing the layout does fails their guards), the compile
ahead must change no number (parameters bitwise, no gradient left), and the steps (compiled blocks and
compiled loss) must be eager's within tests/test_speed.py's compile tolerance (1e-5 relative: the module
doc there says why; the loss adds one fused log-softmax, a few units of the last place)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

from tests.checkpoint_fixtures import free_port
from tests.conftest import job
from tests.ranks import run_ranks
from tests.test_speed import COMPILE_LOSS_RTOL, _spec


def _compiles() -> int:
    """Graphs dynamo traced plus graphs inductor compiled or fetched from its cache (a backward is compiled
    lazily, at its first run: no dynamo frame of its own)."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return counters["stats"]["unique_graphs"] + c["fxgraph_cache_hit"] + c["fxgraph_cache_miss"] + c["fxgraph_cache_bypass"]


def _runs(rank: int, out: str) -> None:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from elastictrain.config import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # no pool of compile workers on a 2-core machine
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    results: dict[str, Any] = {}
    try:
        for name, parallel in (("eager", {}), ("ahead", {"compile": True})):
            cfg = build_config(_spec(1, plan="ddp", **parallel))
            runner = StepRunner(dataclasses.replace(builtin_task(cfg), lr_fn=None), cfg.train, FaultInjector(()),
                                parallel=cfg.parallel)
            if name == "ahead":  # the standby's set-up ahead (Worker.setup with no slot)
                before = {k: v.detach().clone() for k, v in runner.model.state_dict().items()}
                frames, compiles = counters["stats"]["unique_graphs"], _compiles()
                results["ahead_ran"] = runner.compile_ahead()
                results["ahead_frames"] = counters["stats"]["unique_graphs"] - frames
                results["ahead_compiles"] = _compiles() - compiles
                results["unchanged"] = all(torch.equal(before[k], v) for k, v in runner.model.state_dict().items())
                results["grads_left"] = [n for n, p in runner.model.named_parameters() if p.grad is not None]
            compiles = _compiles()
            runner.attach(0, 1, 0, resolve(spec_from_config(cfg), 1))  # the take: the replacement's layout
            records = [runner.run_step(False)[0] for _ in range(cfg.train.steps)]
            results[name] = {"losses": [r.loss for r in records], "params": runner.state.full_model_state(),
                             "take_compiles": _compiles() - compiles,
                             "compile_s": [r.compile_s for r in records]}
        torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # one inductor compile of a block: ~20 s of CPU (C++ builds)
def test_a_standby_compiles_ahead_and_its_take_compiles_nothing_and_trains_like_eager(tmp_path):
    out = str(tmp_path / "runs.pt")
    run_ranks(_runs, (out,), nprocs=1)
    runs = torch.load(out)
    assert runs["ahead_ran"] and runs["unchanged"] and runs["grads_left"] == []
    # the blocks (one graph: same code, same shapes) and the loss, each with its forward and backward
    assert runs["ahead_frames"] == 2 and runs["ahead_compiles"] == 2 + 4
    eager, ahead = runs["eager"], runs["ahead"]
    assert ahead["take_compiles"] == 0, "the replacement compiled: the model compiled ahead was not the one taken"
    assert eager["take_compiles"] == 0 and len(eager["losses"]) == 3
    for step, (a, b) in enumerate(zip(ahead["losses"], eager["losses"], strict=True), 1):
        assert abs(a - b) <= COMPILE_LOSS_RTOL * abs(b), (step, a, b)
    for name, t in eager["params"].items():
        assert torch.allclose(ahead["params"][name], t, rtol=0, atol=1e-5), name
    # the first step still reports compile_s (the generation's first under parallel.compile), now small
    assert ahead["compile_s"][0] is not None and ahead["compile_s"][1:] == [None, None]


def test_the_builtin_task_compiles_its_loss_only_under_parallel_compile():
    from elastictrain.config import build_config
    from elastictrain.task import _gpt_loss, _gpt_loss_compiled, _gpt_stage_loss, _gpt_stage_loss_compiled, builtin_task

    eager, compiled = (builtin_task(build_config(_spec(2, compile=c))) for c in (False, True))
    assert eager.loss_fn is _gpt_loss and eager.pipeline.loss_fn is _gpt_stage_loss
    assert compiled.loss_fn is _gpt_loss_compiled and compiled.pipeline.loss_fn is _gpt_stage_loss_compiled
    assert compiled.pipeline.stage_fn is eager.pipeline.stage_fn


def test_compile_ahead_does_nothing_where_it_cannot_help():
    """compile off, or a model on the meta device (parallel.meta_init: no values to run): nothing runs, the
    model is left as built (no wrapper, no compiled block)."""
    import dataclasses

    from elastictrain.config import build_config
    from elastictrain.parallel.parallelize import repeated_blocks
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    for parallel in ({"plan": "fsdp"}, {"plan": "fsdp", "compile": True, "meta_init": True}):
        cfg = build_config(_spec(2, **parallel))
        runner = StepRunner(dataclasses.replace(builtin_task(cfg), lr_fn=None), cfg.train, FaultInjector(()),
                            parallel=cfg.parallel)
        assert runner.compile_ahead() is False, parallel
        assert all(getattr(b, "_compiled_call_impl", None) is None for b in repeated_blocks(runner.model))


# --------------------------------------------------------------------- tensor-parallel Llama, compiled


def _llama_tp(rank: int, port: int, out: str) -> None:
    """One rank of a tp2 group (sequence parallel): the debug Llama eager, then compiled, 3 steps each."""
    import datetime

    import torch.distributed as dist

    from elastictrain.config import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    results = {}
    try:
        for compiled in (False, True):
            cfg = build_config(job(task={"kind": "llama", "llama": {"size": "debug"},
                                         "model": {"seq_len": 16, "dropout": 0.0}},
                                   train={"steps": 3, "global_batch": 4, "micro_batch": 2},
                                   workers={"min": 2, "max": 2}, parallel={"tp": 2, "compile": compiled}))
            runner = StepRunner(dataclasses.replace(builtin_task(cfg), lr_fn=None), cfg.train, FaultInjector(()),
                                parallel=cfg.parallel)
            runner.attach(rank, 2, 0, resolve(spec_from_config(cfg), 2))
            if runner.uninitialized:
                runner.init_from_seed()
            losses = [runner.run_step(False)[0].loss for _ in range(cfg.train.steps)]
            results[compiled] = {"losses": losses, "params": runner.state.full_model_state()}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes compile the Llama's blocks: ~20 s of CPU each
def test_the_tensor_parallel_llama_compiles_and_trains_like_eager(tmp_path):
    """torch 2.13's compiled block hands the gradient of an input that came from an asynchronous collective
    back as a plain tensor, and DTensor's redistribute backward fails on it (AttributeError:
    ``_local_tensor``): the Llama's embedding feeds its first block directly, so its collective is
    synchronous (``RowwiseParallelSync``). Tolerance: tests/test_speed.py's."""
    out = str(tmp_path / "tp.pt")
    run_ranks(_llama_tp, (free_port(), out), nprocs=2)
    runs = torch.load(out)
    eager, compiled = runs[False], runs[True]
    for step, (a, b) in enumerate(zip(compiled["losses"], eager["losses"], strict=True), 1):
        assert abs(a - b) <= COMPILE_LOSS_RTOL * abs(b), (step, a, b)
    for name, t in eager["params"].items():
        assert torch.allclose(compiled["params"][name], t, rtol=0, atol=1e-5), name
