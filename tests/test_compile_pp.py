"""``parallel.compile`` under pipeline parallelism (issue 38: "compile under every layout"): each stage's
blocks compiled (``apply_block_transforms`` on the stage module, elastictrain/parallel/pipeline.py), the
debug Llama on 2 gloo ranks (pp2, one stage each), eager then compiled, 3 steps each, through the worker's
own step path (StepRunner.attach + init_from_seed + run_step).

Tolerance: tests/test_speed.py's (1e-5 relative on each step's loss, 1e-5 absolute on the final parameters;
its module doc says why: inductor fuses elementwise ops and may sum in another order). Also checked: the
compiled run really compiled (the stage's blocks carry a compiled call, dynamo traced graphs in the step)
and only the generation's first step reports ``compile_s`` (what goodput's ``compile_s`` counts)."""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import pytest
import torch

from tests.checkpoint_fixtures import free_port
from tests.conftest import job
from tests.ranks import run_ranks
from tests.test_speed import COMPILE_LOSS_RTOL


def _llama_pp(rank: int, port: int, out: str, parallel: dict[str, Any] | None = None, world: int = 2) -> None:
    """One rank: the debug Llama eager then compiled under ``parallel`` (default pp2), 3 steps each; saves
    its losses, compile_s, gathered model, graphs traced and blocks compiled to ``out`` (``_{rank}.pt``)."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from elastictrain.config import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.parallel.parallelize import repeated_blocks
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # no pool of compile workers on a 2-core machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    results: dict[bool, dict[str, Any]] = {}
    try:
        for compiled in (False, True):
            cfg = build_config(job(task={"kind": "llama", "llama": {"size": "debug"},
                                         "model": {"seq_len": 16, "dropout": 0.0}},
                                   train={"steps": 3, "global_batch": 2 * world, "micro_batch": 2},
                                   workers={"min": world, "max": world},
                                   parallel={**(parallel or {"pp": 2}), "compile": compiled}))
            runner = StepRunner(dataclasses.replace(builtin_task(cfg), lr_fn=None), cfg.train, FaultInjector(()),
                                parallel=cfg.parallel)
            runner.attach(rank, world, 0, resolve(spec_from_config(cfg), world))
            if runner.uninitialized:
                runner.init_from_seed()
            graphs = counters["stats"]["unique_graphs"]
            records = [runner.run_step(False)[0] for _ in range(cfg.train.steps)]
            modules = getattr(runner.pm, "modules", None) or [runner.pm.model]  # this rank's stages, or its model
            blocks = [b for module in modules for b in repeated_blocks(module)]
            results[compiled] = {
                "losses": [r.loss for r in records], "compile_s": [r.compile_s for r in records],
                "params": runner.state.full_model_state(), "graphs": counters["stats"]["unique_graphs"] - graphs,
                "blocks": len(blocks),
                "compiled_blocks": sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)}
        torch.save(results, out.replace(".pt", f"_{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # each of two processes compiles its stage's block with inductor: ~20 s of CPU each
def test_the_pipelined_llama_compiles_each_stage_and_trains_like_eager(tmp_path):
    out = str(tmp_path / "pp.pt")
    run_ranks(_llama_pp, (free_port(), out), nprocs=2)
    ranks = [torch.load(out.replace(".pt", f"_{r}.pt")) for r in (0, 1)]
    for rank, runs in enumerate(ranks):
        eager, compiled = runs[False], runs[True]
        assert compiled["blocks"] == 1 and compiled["compiled_blocks"] == 1, (rank, compiled)  # one layer a stage
        assert eager["compiled_blocks"] == 0 and eager["graphs"] == 0 and compiled["graphs"] > 0, rank
        assert compiled["compile_s"][0] is not None and compiled["compile_s"][1:] == [None, None], rank
        assert eager["compile_s"] == [None, None, None]
        for step, (a, b) in enumerate(zip(compiled["losses"], eager["losses"], strict=True), 1):
            assert abs(a - b) <= COMPILE_LOSS_RTOL * abs(b), (rank, step, a, b)
        assert set(compiled["params"]) == set(eager["params"]) and bool(eager["params"]) == (rank == 0)  # gathered
        for name, t in eager["params"].items():
            assert torch.allclose(compiled["params"][name], t, rtol=0, atol=1e-5), (rank, name)
    assert ranks[0][True]["losses"] == ranks[1][True]["losses"]  # every rank reports the step's loss
