"""Held-out evaluation (``train.eval_every``) under every layout that splits the model: tp2 (every tp rank
runs the forward together under ``loss_parallel``, tp coordinate 0 counts the loss) and pp2 (a forward-only
pass of the pipeline schedule, the last stage scores; 1f1b, and interleaved_1f1b with two stages a rank) give
the held-out losses of ddp2 and of one process, and the training steps after an evaluation keep their
numbers (the schedule switches between eval and training). On gloo processes without Ray: the worker's step
path (``StepRunner``), the tiny GPT with 2 blocks and dropout on (off in evaluation). The zbv schedule has no
forward-only pass in torch 2.13: refused.

Tolerance: 1e-5 relative, the layouts' own (tests/parallel_fixtures.py): tp and pp compute one process's
math with fp32 sums in another order (tp: the row-parallel linears' partial sums, the sharded cross-entropy;
pp2 x dp1: the gradients accumulated over 4 micro-batches on one rank instead of 2 x 2 then averaged), which
moved a loss by at most 4.3e-8 relative here; the held-out loss is a float64 sum of those per-sample losses.

Broken builds (2026-11-28, each failing here): every tp rank counting its eval losses (``counts_loss``
ignored in ``ParallelModel.eval_loss_sum``): the tp2 eval losses doubled; the pipeline's last stage scoring
the windows against the wrong rows (``target`` rows reversed in ``PipelineModel._feed``): pp2's eval loss
off by 2e-3 relative; the pipeline evaluating with a training ``schedule.step`` (a backward whose gradients
leak into the next step) instead of ``schedule.eval``: pp2's step-2 eval loss off by 4.5e-3."""

from __future__ import annotations

import copy

from tests.conftest import BASE_JOB, job

TASK = {**copy.deepcopy(BASE_JOB["task"]), "model": {**BASE_JOB["task"]["model"], "n_layer": 2}}
# (interleaved_1f1b: two stages a rank, torch's multi-stage schedule, 4 blocks)
LAYOUTS = {1: [{}, {"n_layer": 4}],
           2: [{}, {"tp": 2}, {"pp": 2}, {"pp": 2, "pp_schedule": "interleaved_1f1b", "n_layer": 4}]}
RTOL = 1e-5


def _eval_rank(rank: int, world: int, items: list[dict], port: int, out: str) -> None:
    """One rank: for each layout of ``items`` (``parallel`` keys; ``n_layer``: the model's blocks), 2 steps
    with a held-out evaluation after each (the training windows as the validation split: what is scored does
    not matter, only that every layout scores the same); rank 0 saves every layout's step records'
    (loss, eval_loss)."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from elastictrain.config import build_config
    from elastictrain.task import builtin_task
    from tests.ranks import attached_runner, join_gloo

    join_gloo(rank, world, port)
    try:
        got = []
        for item in items:
            parallel = {k: v for k, v in item.items() if k != "n_layer"}
            task = copy.deepcopy(TASK)
            task["model"]["n_layer"] = item.get("n_layer", task["model"]["n_layer"])
            spec = job(task=task, train={"steps": 2, "global_batch": 16, "micro_batch": 4},
                       workers={"min": world, "max": world}, parallel={"plan": "ddp", **parallel})
            task = builtin_task(build_config(spec))  # (a built-in job with eval_every needs a prepared split)
            cfg = build_config(spec | {"train": {**spec["train"], "eval_every": 1, "eval_batches": 2}})
            runner = attached_runner(cfg, rank, world, task=dataclasses.replace(task, eval_dataset_fn=task.dataset_fn))
            got.append([(r.loss, r.eval_loss) for r in (runner.run_step(False)[0] for _ in range(2))])
            runner.close_data()
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


def test_eval_under_tp2_and_pp2_scores_the_losses_of_ddp2_and_one_process(tmp_path) -> None:
    from tests.ranks import run_world

    one, four_blocks = run_world(_eval_rank, tmp_path, 1, LAYOUTS[1])
    two = dict(zip(("ddp2", "tp2", "pp2", "pp2 interleaved"), run_world(_eval_rank, tmp_path, 2, LAYOUTS[2]),
                   strict=True))
    assert all(ev is not None for _, ev in one) and one[1][1] < one[0][1], one  # it scored, and learned
    for name, records in two.items():
        ref = four_blocks if name == "pp2 interleaved" else one
        for step, ((loss, ev), (ref_loss, ref_ev)) in enumerate(zip(records, ref, strict=True), 1):
            assert abs(ev - ref_ev) <= RTOL * ref_ev, (name, step, ev, ref_ev)
            assert abs(loss - ref_loss) <= RTOL * ref_loss, (name, step, loss, ref_loss)


def test_eval_under_zbv_is_refused_naming_why() -> None:
    """torch 2.13's ZBV schedule has no forward-only pass (its ``schedule.eval`` fails with "can't
    steal_bwd_input", seen 2026-11-28): eval under it is one config line naming why and the fix."""
    import pytest

    from elastictrain import build_config
    from elastictrain.config import ConfigError

    spec = job(task={**copy.deepcopy(TASK), "model": {**TASK["model"], "n_layer": 4}}, train={"eval_every": 2},
               workers={"min": 2, "max": 2}, parallel={"pp": 2, "pp_schedule": "zbv"})
    with pytest.raises(ConfigError) as e:
        build_config(spec)
    line = str(e.value)
    assert "\n" not in line and "train.eval_every=2 with parallel.pp_schedule=zbv" in line, line
    assert "steal_bwd_input" in line and "set train.eval_every=0" in line, line
    assert build_config(spec | {"parallel": {"pp": 2, "pp_schedule": "zero_bubble"}}).train.eval_every == 2
