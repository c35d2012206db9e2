"""``parallel.mixed_precision: bf16`` without FSDP (plan ddp: dp4, pp2 x dp2, tp2 x dp2 on 4 gloo ranks), for
the built-in GPT and Llama: every step's loss and the final parameters match one process computing under
``torch.autocast(bf16)``; the forward really runs in bf16 on every rank and stage; parameters, gradients
and optimizer moments stay fp32.

Tolerance. The one-process reference runs the same bf16 operations on the same per-sample inputs, so what
differs is (a) the order of fp32 sums (gradients over micro-batches and ranks, the clipping norm), as in
tests/test_pipeline.py, and (b) under tp2 the row-parallel linears' partial products: each rank's half of
the contraction leaves autocast rounded to bf16 and the halves are summed, where one process rounds the
whole sum once -- one extra bf16 rounding (<= 2^-9 relative) per element of those outputs, independent
across elements, so largely averaged out in the loss (a mean over 16 x 32 token losses). bf16 also makes
the forward a step function of the fp32 master weights (each is rounded to bf16 when cast), so a
summation-order difference of one ulp occasionally moves a weight's bf16 copy by one bf16 ulp.
Losses: 2e-4 relative (measured: ddp4 and Llama pp2 <= 1e-7, GPT pp2 <= 1e-5, tp2 <= 7e-5; a tp2 build
whose data-parallel gradient average was dropped missed by 1e-2 at step 2). Parameters: AdamW's first
updates are ~lr * sign(g), so an element whose gradient is near zero steps +-lr on any perturbation at all;
the final parameters of two runs that differ by any rounding therefore drift apart by a few percent of the
distance travelled (``_drift``; measured: bf16 against fp32 3.5-4.4%, tp2 2.8-4.7%, GPT pp2 0.4%, ddp4 and
Llama pp2 ~1e-8). We allow 10%. The loss band is not what tells bf16 from fp32 on a model this small
(their losses differ by 2e-6..8e-5 relative): the dtypes the linears compute in, recorded on every rank
and stage, are (a pipeline stage run outside autocast computes fp32 there and fails).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import pytest
import torch

from tests.conftest import job
from tests.ranks import run_world

LOSS_RTOL = 2e-4
DRIFT = 0.1
STEPS = 3
GPT = {"model": {"seq_len": 32, "n_layer": 2, "n_head": 2, "d_model": 32, "dropout": 0.1}}
LLAMA = {"kind": "llama", "llama": {"size": "debug", "dim": 32, "ffn_hidden": 64}, "model": {"seq_len": 32}}
LAYOUTS = ({"plan": "ddp"}, {"pp": 2}, {"tp": 2})


def _spec(world: int, task: dict[str, Any], parallel: dict[str, Any]) -> dict[str, Any]:
    return job(task={**task, "optimizer": {"lr": 3e-3, "warmup_steps": 5}},
               train={"steps": STEPS, "global_batch": 16, "micro_batch": 2},
               workers={"min": world, "max": world}, parallel=parallel)


def _train(rank: int, world: int, runs: list[tuple[dict[str, Any], dict[str, Any]]], port: int, out: str) -> None:
    """One rank: each ``(task, parallel)`` of ``runs`` through the worker's StepRunner (seeded init, STEPS
    steps) on one gloo group; rank 0 saves the losses, the whole model, and every rank's dtypes: of the
    linears' outputs in forward, of the parameters, gradients and optimizer state."""
    import torch.distributed as dist

    from elastictrain.config import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = []
    try:
        for task_section, parallel in runs:
            cfg = build_config(_spec(world, task_section, parallel))
            task = dataclasses.replace(builtin_task(cfg), lr_fn=None)
            runner = StepRunner(task, cfg.train, FaultInjector(()), parallel=cfg.parallel)
            runner.attach(rank, world, 0, resolve(spec_from_config(cfg), world))
            if runner.uninitialized:
                runner.init_from_seed()
            seen: set[str] = set()
            grads: set[str] = set()
            for m in runner.model.modules():
                if isinstance(m, torch.nn.Linear):
                    m.register_forward_hook(lambda mod, args, o: seen.add(_dtype(o)))
            for p in runner.model.parameters():  # as accumulated (the step then drops or zeroes them)
                p.register_post_accumulate_grad_hook(lambda p: grads.add(_dtype(p.grad)))
            start = {k: v.detach().clone() for k, v in runner.state.full_model_state().items()}
            losses = [runner.run_step(False)[0].loss for _ in range(STEPS)]
            state = runner.state.optimizer.state.values()
            mine = {"linear_out": seen,
                    "params": {_dtype(p) for p in runner.model.parameters()},
                    "grads": grads,
                    "optim": {_dtype(v) for s in state for k, v in s.items()
                              if isinstance(v, torch.Tensor) and k != "step"}}
            every: list[Any] = [None] * world
            dist.all_gather_object(every, mine)
            full = runner.state.full_model_state()
            results.append({"losses": losses, "params": full, "start": start,
                            "dtypes": {k: set().union(*(d[k] for d in every)) for k in mine}})
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _run(tmp_path, world: int, runs: list) -> list:
    return run_world(_train, tmp_path, world, runs)


BF16 = {"mixed_precision": "bf16"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    """One process, each model: bf16 (autocast), then fp32."""
    runs = [(t, p) for t in (GPT, LLAMA) for p in (BF16, {})]
    got = _run(tmp_path_factory.mktemp("ref"), 1, runs)
    return {"gpt": got[0:2], "llama": got[2:4]}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    """4 gloo ranks, each model, each layout of LAYOUTS with bf16."""
    runs = [(t, {**layout, **BF16}) for t in (GPT, LLAMA) for layout in LAYOUTS]
    got = _run(tmp_path_factory.mktemp("w4"), 4, runs)
    n = len(LAYOUTS)
    return {"gpt": got[:n], "llama": got[n:]}


def _close(run: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    for step, (a, b) in enumerate(zip(run["losses"], ref["losses"]), start=1):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (what, step, a, b)
    assert run["params"].keys() == ref["params"].keys(), what
    assert _drift(run, ref) <= DRIFT, (what, _drift(run, ref))


FP32 = {"float32"}


def _drift(run: dict[str, Any], ref: dict[str, Any]) -> float:
    """How far ``run``'s final parameters are from ``ref``'s, relative to how far ``ref`` moved from the
    (shared) seeded start: ||p_run - p_ref|| / ||p_ref - p_start|| over all parameters."""
    diff = sum(float((run["params"][k] - v).double().pow(2).sum()) for k, v in ref["params"].items())
    moved = sum(float((v - ref["start"][k]).double().pow(2).sum()) for k, v in ref["params"].items())
    return (diff / moved) ** 0.5


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_the_reference_computes_in_bf16_and_keeps_fp32_state(reference, model) -> None:
    bf16, fp32 = reference[model]
    assert bf16["dtypes"] == {"linear_out": {"bfloat16"}, "params": FP32, "grads": FP32, "optim": FP32}
    assert fp32["dtypes"]["linear_out"] == FP32
    assert all(a != b for a, b in zip(bf16["losses"], fp32["losses"])), model  # bf16 is in effect
    assert bf16["losses"][-1] < bf16["losses"][0]  # it trains


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=["ddp4", "pp2xdp2", "tp2xdp2"])
def test_bf16_without_fsdp_trains_the_one_process_numbers(four_ranks, reference, model, index) -> None:
    run = four_ranks[model][index]
    what = f"{model} {LAYOUTS[index]}"
    # every rank's (and stage's) linears computed in bf16; parameters, gradients and Adam's moments are fp32
    assert run["dtypes"] == {"linear_out": {"bfloat16"}, "params": FP32, "grads": FP32, "optim": FP32}, what
    _close(run, reference[model][0], what)
    assert {v.dtype for v in run["params"].values()} == {torch.float32}
