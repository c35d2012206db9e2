"""Sharded layouts on real processes (Ray actors, gloo): FSDP2 and HSDP train the same numbers as one
process (the worker's step loop on one rank in the test's own process: tests/parallel_fixtures.py), a checkpoint written under one plan and world size resumes under another, and the step loop's
layout-agnostic parts (accumulation, clipping, export) work with DTensors.

Tolerance: the layouts differ from one process only in the order of fp32 sums (DDP/FSDP all-reduce and
reduce-scatter add rank partial sums; one process adds micro-batch gradients). Each step's gradient then
differs by a few ulps (relative ~1e-7); AdamW normalises updates, so parameter differences stay at the
scale of lr * 1e-6. We allow 1e-5 relative on losses and 1e-5 absolute on parameters (|w| ~ 0.02-1):
a layout bug (a missing reduction, a wrong scale, a shard applied twice) moves them by >= 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import job, run_job
from tests.parallel_fixtures import (LOSS_RTOL, PARAM_ATOL, RECOVERY_PARAM_ATOL, InProcessRun,
                                     assert_grew_back_from_the_last_step, assert_same_numbers)


def _spec(plan: str, world: int, steps: int = 4, **sections):
    return job(train={"steps": steps, "global_batch": 16, "micro_batch": 2},
               workers={"min": world, "max": world}, parallel={"plan": plan}, **sections)


def _constant_lr_task(spec):
    """The built-in task without its schedule (which depends on train.steps), so runs of different
    lengths share one trajectory."""
    import dataclasses

    from elastictrain import build_config
    from elastictrain.task import builtin_task

    return dataclasses.replace(builtin_task(build_config(spec)), lr_fn=None)


def _xplan(plan: str, world: int, steps: int, ckpt: dict) -> dict:
    """A phase of the cross-plan run: 24 samples a step (12 micro-batches: every world size here divides
    them), run id ``xplan``, a checkpoint every 4 steps (``ckpt``); trained with :func:`_constant_lr_task`."""
    spec = _spec(plan, world, steps=steps, checkpoint=ckpt, run_id="xplan")
    spec["train"] = {**spec["train"], "global_batch": 24}
    return spec


@pytest.fixture(scope="module")
def one_process() -> InProcessRun:
    """The 4 steps of ``_xplan`` in one process (this one), trained once for both layouts below."""
    spec = _xplan("ddp", 1, 4, {})
    return InProcessRun(spec, task=_constant_lr_task(spec))


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """``sharded_run(plan, world)``: the finished 4-step ``_xplan`` run of that layout, trained once for the
    module. The hsdp-4 one is also the first phase of the cross-plan resume (its checkpoint of step 4 is
    where the ddp phase starts; the later phases commit steps 8 and 12 beside it, and keep_last 3 keeps it)."""
    from tests.conftest import _ensure_local_ray

    done: dict[tuple[str, int], tuple[object, str]] = {}

    def get(plan: str, world: int):
        if (plan, world) not in done:
            _ensure_local_ray()
            tmp = tmp_path_factory.mktemp(f"{plan}{world}")
            spec = _xplan(plan, world, 4, {"uri": str(tmp / "ckpt"), "every_steps": 4})
            done[(plan, world)] = run_job(tmp, spec, task=_constant_lr_task(spec), name=f"{plan}{world}"), str(tmp)
        return done[(plan, world)]

    return get


@pytest.mark.parametrize("plan,world", [("fsdp", 2), ("hsdp", 4)])
def test_sharded_layout_matches_one_process(ray_local, one_process, sharded_run, plan, world):
    ref = one_process
    run, _ = sharded_run(plan, world)  # its checkpoint (step 4) changes no number
    assert run.result.exit_code == 0
    steps = run.of("step")
    assert {e["world_size"] for e in steps} == {world} and {e["accum"] for e in steps} == {12 // world}
    assert_same_numbers(run, ref)


def test_checkpoint_resumes_across_plans_and_world_sizes(ray_local, sharded_run):
    """hsdp on 4 -> ddp on 2 -> fsdp on 3 workers, each phase resuming the previous one's checkpoint: the
    same losses and final parameters as 12 uninterrupted steps in one process. The hsdp phase is
    test_sharded_layout_matches_one_process's hsdp-4 run."""
    first, root = sharded_run("hsdp", 4)
    tmp_path = Path(root)
    ckpt = {"uri": str(tmp_path / "ckpt"), "every_steps": 4}
    phases = [("hsdp", 4, 4), ("ddp", 2, 8), ("fsdp", 3, 12)]
    runs = [first]
    assert first.result.exit_code == 0, first.summary
    for plan, world, steps in phases[1:]:
        spec = _xplan(plan, world, steps, ckpt)
        runs.append(run_job(tmp_path, spec, task=_constant_lr_task(spec), name=f"{plan}{world}"))
        assert runs[-1].result.exit_code == 0, runs[-1].summary
    ref_spec = _spec("ddp", 1, steps=12)
    ref_spec["train"] = {**ref_spec["train"], "global_batch": 24}
    ref = InProcessRun(ref_spec, task=_constant_lr_task(ref_spec))
    for run, (plan, world, steps) in zip(runs[1:], phases[1:]):
        (resumed,) = run.of("resumed")
        assert resumed["step"] == steps - 4 and resumed["world_size"] == world
    losses = {s: l for run in runs for s, l in run.losses().items()}
    assert sorted(losses) == list(range(1, 13))
    for step, loss in ref.losses().items():
        assert abs(losses[step] - loss) <= LOSS_RTOL * abs(loss), (step, losses[step], loss)
    pr, pf = runs[-1].final_params(), ref.final_params()
    assert max((pr[k] - pf[k]).abs().max().item() for k in pf) <= PARAM_ATOL


def test_fsdp_worker_killed_restores_shards_and_grows_back(tmp_path, ray_local):
    """Under fsdp a dead rank's shard exists nowhere else (no in-memory tier here): the survivor restores
    the last committed checkpoint through the same DCP reader path, resharded to 1 worker; when the
    replacement is ready the group stops at a boundary and re-meshes on 2 from the survivor's snapshot (the
    survivor is held before its first folded step until then: tests/grow_gate.py)."""
    from elastictrain.data.cursor import step_sample_ids
    from elastictrain.data.datasets import TokenWindows, load_text_tokens
    from tests.cluster_fixtures import SLOW
    from tests.grow_gate import assert_held_one_step, hold_until_grown
    from tests.step_checks import assert_checkpoints_carry_their_steps, assert_each_step_counted_once

    # late enough that earlier saves were committed (saves in flight at the kill are abandoned, never commit)
    kill = {"rank": 1, "step": 17, "point": "mid_step", "kind": "kill"}
    steps = 24  # the kill at 17, the folded step, then 2 again
    base = dict(train={"steps": steps, "audit_samples": True, "global_batch": 16, "micro_batch": 4},
                workers={"min": 1, "max": 2}, parallel={"plan": "fsdp"})
    ckpt = {"every_steps": 2, "memory_every_steps": 0}  # the durable path only (the tier is on by default)
    faulty = run_job(tmp_path, job(**base, checkpoint={**ckpt, "uri": str(tmp_path / "f")},
                                   faults=SLOW + [kill, *hold_until_grown(1)]), name="f")
    # the uninterrupted steps in one process (this one): fsdp on 2 differs from it by fp32 sum order only
    clean = InProcessRun(job(**{**base, "workers": {"min": 1, "max": 1}, "parallel": {"plan": "ddp"}}))
    assert faulty.result.exit_code == 0, faulty.summary
    (failure,) = faulty.of("failure")
    assert failure["kind"] == "process_died" and failure["rank"] == 1
    recovered = faulty.of("recovered")[0]
    # Lost work: back to the last committed checkpoint (saves every 2 steps; a save commits once every
    # rank reported it, so the one in flight at the kill may not count).
    # (a commit runs on the committer thread: one may land between the failure and the choice of source)
    committed = [e["step"] for e in faulty.of("checkpoint_saved")]
    before = [e["step"] for e in faulty.of("checkpoint_saved") if e["time"] < failure["time"]]
    assert recovered["source"] == "checkpoint" and recovered["step"] in committed, (recovered, committed)
    assert max(before, default=0) <= recovered["step"] <= failure["step"], (recovered, before, failure)
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in faulty.of("resized")]
    assert sizes[:2] == [(2, 1), (1, 2)], sizes
    # Sample audit: the steps redone after the restore replace the lost ones; every step's samples are
    # exactly its global-cursor samples.
    n = len(TokenWindows(load_text_tokens("builtin:pydoc"), 32))
    last = {e["step"]: e for e in faulty.of("step")}
    assert sorted(last) == list(range(1, steps + 1))
    for step, e in last.items():
        assert sorted(e["sample_ids"]) == sorted(step_sample_ids(step - 1, 16, 0, n).tolist())
    # every step's loss (those redone after the restore too) and the final parameters: fsdp on 2, on 1 while
    # folded, and one process differ by fp32 sum order only (the parameters' tolerance: RECOVERY_PARAM_ATOL)
    assert_same_numbers(faulty, clean, param_atol=RECOVERY_PARAM_ATOL)
    assert_grew_back_from_the_last_step(faulty)
    assert_held_one_step(faulty)
    # each step counts once (issue #40): a step redone after the restore supersedes its first event, marked
    # `redone`; the first attempt's time is goodput's redone_s; every checkpoint carries its steps' records
    redone = assert_each_step_counted_once(faulty)
    assert redone == list(range(recovered["step"] + 1, recovered["step"] + 1 + len(redone))), (redone, recovered)
    assert_checkpoints_carry_their_steps(faulty)


def test_hugging_face_gpt2_shape_under_fsdp(tmp_path, ray_local):
    pytest.importorskip("transformers", reason="transformers is not installed: the GPT-2-shaped model needs it")
    import dataclasses

    from elastictrain.parallel.parallelize import repeated_blocks
    from tests.parallel_fixtures import HFGPT2, hf_loss

    assert len(repeated_blocks(HFGPT2()())) == 2  # the default layout finds transformer.h's blocks
    def task(spec):
        return dataclasses.replace(_constant_lr_task(spec), model_fn=HFGPT2(), loss_fn=hf_loss)

    ddp = _spec("ddp", 1, steps=3)
    ref = InProcessRun(ddp, task=task(ddp))
    fsdp = _spec("fsdp", 2, steps=3)
    run = run_job(tmp_path, fsdp, task=task(fsdp), name="hffsdp")
    assert run.result.exit_code == 0, run.summary
    assert_same_numbers(run, ref)
