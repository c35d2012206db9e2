"""Pipeline parallelism (parallel.pp) on real processes: every torch schedule on 2 gloo ranks and pp2 x dp2
(ddp, fsdp) on 4 train the same numbers as one process with dropout on; a pp2 run through the controller on
local Ray finishes and its checkpoint resumes under ddp1 with the numbers of an uninterrupted run.

Tolerance (the same as tests/test_parallel.py, and why): a pipeline computes every sample's forward and
backward with the same operations as one process -- the stage boundary only moves an activation between
processes, and each sample's dropout masks come from its own seed -- so the per-sample losses are bitwise
those of one process. What differs is the order of fp32 sums: a stage's parameter gradient sums the
micro-batches in the schedule's order (and, with dp2, over two ranks), and the clipping norm is
sqrt(sum over stages of each stage's squared norm) instead of one fp32 sum. Each step's gradient then
differs by a few ulps (relative ~1e-7); AdamW normalises updates, so parameters differ at the scale of
lr * 1e-6 (measured: <= 9e-7 absolute after 3 steps, losses <= 5e-8 relative). We allow 1e-5 relative on
losses and 1e-5 absolute on parameters (|w| ~ 0.02-1): a pipeline bug (a micro-batch's loss counted twice or
not at all, a stage's gradients not averaged over its replicas, a stage clipping by its own norm, a dropout
mask drawn from another sample's seed) moves them by far more (measured: a missing dp2 gradient average
moved the step-2 loss by 3.6e-3 relative and the parameters by 1.8e-2; each stage clipping by its own norm
moved the step-3 loss by 2.2e-4 relative and the parameters by 1.6e-3; counting torch's shape-inference
loss call made step 1's loss wrong by 12%).
"""

from __future__ import annotations

import copy
import datetime
import importlib.util
import os
from typing import Any

import pytest
import torch

from elastictrain.parallel.pipeline import PipelineError
from tests.checkpoint_fixtures import free_port
from tests.conftest import job, run_job
from tests.ranks import run_ranks, run_world

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
STEPS = 3
MODEL = {"seq_len": 32, "n_layer": 4, "n_head": 2, "d_model": 32, "dropout": 0.1}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")


def _spec(world: int, **parallel: Any) -> dict[str, Any]:
    return job(task={"model": MODEL, "optimizer": {"lr": 3e-3, "warmup_steps": 5}},
               train={"steps": STEPS, "global_batch": 16, "micro_batch": 2, "audit_samples": True},
               workers={"min": world, "max": world}, parallel=parallel)


def _train(rank: int, world: int, layouts: list[dict[str, Any]], port: int, out: str) -> None:
    """One rank: for each of ``layouts`` (parallel sections, one after another on the same gloo group) the
    worker's StepRunner, seeded init, STEPS steps; rank 0 saves each run's losses, step records' pipeline
    fields, audited sample ids and the gathered whole model."""
    import dataclasses

    import torch.distributed as dist

    from elastictrain.config import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)  # as a worker does (cpus_per_worker): two ranks on two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = []
    try:
        for parallel in layouts:
            parallel = dict(parallel)
            llama = parallel.pop("llama", False)
            steps = parallel.pop("steps", STEPS)
            spec = _spec(world, **parallel)
            spec["train"]["steps"] = steps
            cfg = build_config(spec)
            if llama:  # a model the project did not write, through its PipelineHooks (examples/)
                from examples.pipeline_llama import make_task

                overrides = llama if isinstance(llama, dict) else {}  # e.g. tie_word_embeddings
                task = dataclasses.replace(make_task(seq_len=MODEL["seq_len"], **overrides), lr_fn=None)
            else:
                task = dataclasses.replace(builtin_task(cfg), lr_fn=None)
            runner = StepRunner(task, cfg.train, FaultInjector(()), audit=True, parallel=cfg.parallel)
            runner.attach(rank, world, 0, resolve(spec_from_config(cfg), world))
            if runner.uninitialized:
                runner.init_from_seed()
            phases: list[str] = []
            set_phase = runner._set_phase
            runner._set_phase = lambda name: (phases.append(name), set_phase(name))  # type: ignore[method-assign]
            records = [runner.run_step(False)[0] for _ in range(steps)]
            full = runner.state.full_model_state()
            results.append({"losses": [r.loss for r in records], "pipeline": [r.pipeline for r in records],
                            "ids": [sorted(r.sample_ids) for r in records], "params": full,
                            "phases": phases})
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _run(tmp_path, world: int, layouts: list) -> list:
    return run_world(_train, tmp_path, world, layouts)


HAS_HF = importlib.util.find_spec("transformers") is not None


# the built-in GPT for 6 steps in one process: the uninterrupted run a pp2 -> ddp1 resume must equal
LONG = 6


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory) -> list[dict[str, Any]]:
    """One process: the built-in GPT, (with transformers) the Llama of examples/pipeline_llama.py, and last
    the built-in GPT for ``LONG`` steps."""
    return _run(tmp_path_factory.mktemp("ref"), 1, [{}] + ([{"llama": True}] if HAS_HF else []) + [{"steps": LONG}])


@pytest.fixture(scope="module")
def one_process(one_process_runs) -> dict[str, Any]:
    return one_process_runs[0]


# zero_bubble's split backward with activation checkpointing (pytorch#136766) works on torch 2.13: run too
PP2 = [{"pp": 2, "pp_schedule": s} for s in SCHEDULES] + [
    {"pp": 2, "pp_schedule": "zero_bubble", "activation_checkpointing": True}]
BF16 = {"pp": 2, "pp_schedule": "interleaved_1f1b", "plan": "fsdp", "mixed_precision": "bf16"}
PP2_DP2 = [{"pp": 2, "plan": "ddp"}, {"pp": 2, "plan": "fsdp"}]


@pytest.fixture(scope="module")
def pp2_runs(tmp_path_factory) -> list[dict[str, Any]]:
    """Every layout of PP2 on one pair of processes (one start-up for all); then the Llama on interleaved."""
    extra = [BF16] + ([{"pp": 2, "pp_schedule": "interleaved_1f1b", "llama": True}] if HAS_HF else [])
    return _run(tmp_path_factory.mktemp("pp2"), 2, PP2 + extra)


def _matches(got: dict[str, Any], ref: dict[str, Any]) -> None:
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), 1):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (step, a, b)
    assert got["params"].keys() == ref["params"].keys()  # the whole model, by its own names
    worst = max((got["params"][k].double() - ref["params"][k].double()).abs().max().item() for k in ref["params"])
    assert worst <= PARAM_ATOL, worst
    assert got["ids"] == ref["ids"]  # the audit counts every sample once (first-stage ranks only)


@pytest.mark.parametrize("index", range(len(PP2)), ids=[
    p["pp_schedule"] + ("+ac" if p.get("activation_checkpointing") else "") for p in PP2])
def test_pp2_every_schedule_matches_one_process(pp2_runs, one_process, index):
    got, schedule = pp2_runs[index], PP2[index]["pp_schedule"]
    _matches(got, one_process)
    fields = got["pipeline"][-1]
    assert (fields["pp"], fields["schedule"], fields["n_microbatches"]) == (2, schedule, 8)
    assert fields["stages_per_rank"] == (1 if schedule in ("gpipe", "1f1b") else 2)
    # rank 0 measured idle time: it waits at least for rank 1's first forward and backward (0 is the clamp)
    assert all(0.0 < p["bubble_measured"] < 1.0 for p in got["pipeline"]), got["pipeline"]
    # the watchdog's phase: "compute" around each of rank 0's forward/backward computations (8 micro-batches
    # x its stages x forward + backward per step), "collective" while it waits on its peer, idle after
    computes = sum(1 for a, b in zip(got["phases"], got["phases"][1:]) if a == "collective" and b == "compute")
    assert computes >= STEPS * (2 * 8 - 1) and got["phases"][-1] == "idle", got["phases"][:12]  # 1st: from load
    # the schedule's own idle share at unit costs F = 1, B = 2 (I = W = 1), worked by hand for 2 ranks and
    # 8 micro-batches: gpipe/1f1b (p - 1) / (m + p - 1) = 1/9; interleaved with 2 stages a rank
    # (p - 1) / (v m + p - 1) = 1/17; the zero-bubble schedules one unit idle in 2 x 8 x 3 busy = 1/49
    expected = {"gpipe": 1 / 9, "1f1b": 1 / 9, "interleaved_1f1b": 1 / 17, "zero_bubble": 1 / 49, "zbv": 1 / 49}
    assert fields["bubble_timeline"] == round(expected[schedule], 4), (schedule, fields["bubble_timeline"])


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed: the Llama example needs it")
def test_a_hugging_face_llama_pipelines_through_its_hooks(pp2_runs, one_process_runs):
    """examples/pipeline_llama.py: a model the project did not write, split by its own PipelineHooks,
    trains on pp2 (interleaved, 4 stages) as in one process."""
    got, ref = pp2_runs[len(PP2) + 1], one_process_runs[1]
    _matches(got, ref)
    assert "model.layers.3.mlp.down_proj.weight" in got["params"] and "lm_head.weight" in got["params"]


def test_bf16_stages_stay_near_the_fp32_losses(pp2_runs, one_process):
    """fsdp's bf16 MixedPrecisionPolicy inside interleaved stages: bf16 activations cross the stage boundary;
    losses within 2^-9 relative of fp32 (bf16's rounding, the bound docs/config.md gives for fsdp bf16)."""
    got = pp2_runs[len(PP2)]
    for a, b in zip(got["losses"], one_process["losses"]):
        assert abs(a - b) <= 2**-9 * abs(b), (a, b)
    assert all(t.dtype == torch.float32 for t in got["params"].values())  # fp32 master parameters


def test_pp2_by_dp2_matches_one_process(tmp_path, one_process):
    """pp2 x dp2 on 4 processes, ddp then fsdp inside each stage."""
    for got in _run(tmp_path, 4, PP2_DP2):
        _matches(got, one_process)
        assert got["pipeline"][0]["n_microbatches"] == 4  # G / (D * micro_batch): D = 2 per stage


def test_a_task_without_pipeline_hooks_is_refused():
    from elastictrain.config import build_config
    from elastictrain.parallel.pipeline import build_pipeline
    from elastictrain.parallel.layout import resolve, spec_from_config

    cfg = build_config(_spec(2, pp=2))
    with pytest.raises(PipelineError, match=r"parallel.pp > 1 needs Task.pipeline .*or set parallel.pp=1"):
        build_pipeline(torch.nn.Linear(2, 2), None, resolve(spec_from_config(cfg), 2), 0, None, None,
                       cfg.parallel, torch.device("cpu"))


def test_stage_split_keeps_names_and_refuses_too_few_blocks():
    from elastictrain.models.gpt import GPT, GPTConfig
    from elastictrain.parallel.stages import StageSplitError, block_ranges, local_stages, stage_owner
    from elastictrain.task import GPTStages

    model = GPT(GPTConfig(n_layer=5, seq_len=8, d_model=16))
    names = set(model.state_dict())
    stages = [GPTStages()(model, v, 4) for v in range(4)]
    keys = [set(s.state_dict()) for s in stages]
    assert set().union(*keys) == names and sum(len(k) for k in keys) == len(names)  # disjoint, complete
    assert "tok_emb.weight" in keys[0] and "head.weight" in keys[3] and "blocks.4.q.weight" in keys[3]
    assert [list(r) for r in block_ranges(5, 4)] == [[0, 1], [2], [3], [4]]
    assert [list(r) for r in block_ranges(5, 2, splits=[1])] == [[0], [1, 2, 3, 4]]
    with pytest.raises(StageSplitError, match=r"4 repeated blocks cannot fill 6 pipeline stages"):
        block_ranges(4, 6)
    from elastictrain.parallel.pipeline import StageSet

    merged = StageSet([stages[0], stages[2]])  # a rank's two stages: one module under the whole model's names
    assert set(merged.state_dict()) == keys[0] | keys[2]
    assert set(stages[0].state_dict()) == keys[0]  # the stages themselves are left as they were
    with pytest.raises(PipelineError, match=r"two pipeline stages both hold the parameters of 'tok_emb'"):
        StageSet([stages[0], GPTStages()(copy.deepcopy(model), 0, 4)])
    # torch's conventions: loop (stage v on rank v % pp) and V (rank r holds r and 2pp-1-r)
    assert local_stages("interleaved_1f1b", 2, 4, 0) == [0, 2] and local_stages("zbv", 2, 4, 0) == [0, 3]
    assert stage_owner("zbv", 3, 6) == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}


def test_pp2_run_through_the_controller_resumes_under_ddp1(tmp_path, ray_local, one_process_runs):
    """pp2 (1f1b) through the real controller on local Ray for 4 steps with a checkpoint, then ddp1 resumes
    it to 6 steps: the losses and final model of 6 uninterrupted steps in one process (the worker's step
    loop, as the module's other references)."""
    import dataclasses

    from elastictrain import build_config
    from elastictrain.task import builtin_task

    def spec(world, steps, **parallel):
        s = _spec(world, **parallel)
        s["train"] = {**s["train"], "steps": steps}
        s["checkpoint"] = {"uri": str(tmp_path / "ckpt"), "every_steps": 2, "memory_every_steps": 0}
        s["run_id"] = "pp-resume"
        return s

    def task(s):
        return dataclasses.replace(builtin_task(build_config(s)), lr_fn=None)

    def ref_ids(step):
        from elastictrain.data.cursor import step_sample_ids
        from elastictrain.data.datasets import TokenWindows, load_text_tokens

        n = len(TokenWindows(load_text_tokens("builtin:pydoc"), MODEL["seq_len"]))
        return step_sample_ids(step - 1, 16, 0, n).tolist()

    first = spec(2, 4, pp=2)
    pp = run_job(tmp_path, first, task=task(first), name="pp2")
    assert pp.result.exit_code == 0, pp.summary
    steps = pp.of("step")
    assert {e["world_size"] for e in steps} == {1} and {e["accum"] for e in steps} == {8}
    last = steps[-1]  # the step event's pipeline fields
    assert (last["pp"], last["schedule"], last["n_microbatches"], last["stages_per_rank"]) == (2, "1f1b", 8, 1)
    for e in steps:  # both stages' ranks reported their measured idle share, each one real (0 is the clamp)
        by_rank = e["bubble_by_rank"]
        assert set(by_rank) == {"0", "1"} and all(0.0 < v < 1.0 for v in by_rank.values()), e
        assert min(by_rank.values()) <= e["bubble_measured"] <= max(by_rank.values()), e
    assert sorted(last["sample_ids"]) == sorted(ref_ids(4))  # counted once: from the first stage's rank
    assert pp.summary["goodput"]["degraded_s"] == 0  # the whole world (pp x D = 2 of 2) trained every step
    then = spec(1, LONG)
    ddp = run_job(tmp_path, then, task=task(then), name="ddp1")
    assert ddp.result.exit_code == 0, ddp.summary
    (resumed,) = ddp.of("resumed")
    assert resumed["step"] == 4
    ref = one_process_runs[-1]
    losses = {**pp.losses(), **ddp.losses()}
    assert sorted(losses) == list(range(1, LONG + 1))
    for step, loss in enumerate(ref["losses"], 1):
        assert abs(losses[step] - loss) <= LOSS_RTOL * abs(loss), (step, losses[step], loss)
    pr, pf = ddp.final_params(), ref["params"]
    assert pr.keys() == pf.keys()
    assert max((pr[k] - pf[k]).abs().max().item() for k in pf) <= PARAM_ATOL


def _batch_p2p(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        peer = 1 - rank
        for round_ in range(3):  # send and receive in one batch, both ranks at once (what 1f1b's steady state does)
            out, got = torch.full((4,), float(rank + 10 * round_)), torch.empty(4)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, got, peer)])
            for w in works:
                w.wait()
            if not torch.equal(got, torch.full((4,), float(peer + 10 * round_))):
                raise AssertionError(f"rank {rank} round {round_} received {got.tolist()}")
    finally:
        dist.destroy_process_group()


def test_gloo_batch_p2p_does_not_hang():
    """pytorch#132644 (gloo's batch_isend_irecv hanging, fixed by #152938): on our torch a mixed send/recv
    batch completes (the collective timeout of 30 s would fail it otherwise)."""
    run_ranks(_batch_p2p, (free_port(),), nprocs=2)
