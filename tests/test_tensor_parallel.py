"""Tensor and sequence parallelism (parallel.tp) on real gloo processes through the worker's own step path
(StepRunner.attach + run_step, as tests/test_pipeline.py does): tp2 with and without sequence parallel on 2
processes, tp2 x dp2 (ddp, fsdp) and tp2 x pp2 on 4, tp2 x pp2 x dp2 and tp2 x hsdp on 8 train the numbers of
one process with dropout on (losses, clipping norms, audited samples, gathered parameters); training states
reshard between tp x pp and data-parallel layouts; a Hugging Face Llama runs tensor-parallel through its own
parallelize_fn; tp2 runs through the controller on local Ray and its checkpoint resumes under ddp1; bad tp
configs are refused.

Tolerance (and why): tensor parallelism splits each matrix product of a block over the tp ranks and sums the
partial products in an all-reduce (or reduce-scatter), the vocabulary-parallel cross-entropy sums
exp(logit - max) over vocabulary shards, and a replicated parameter's gradient is summed over ranks: the
same math as one process in another order of fp32 sums. Dropout masks are the same bits (a function of
(seed, step, sample id, position) only). Measured: losses within 4.4e-8 relative, clipping norms within 3e-7;
parameters within 2e-6 absolute except one element of blocks.1.mlp_out.weight at 1.2e-5 in every layout
(AdamW normalises each element's update: an element whose gradient is at the rounding level of its sum gets
an update that differs by up to a fraction of lr = 3e-3). We allow 1e-5 relative on losses and norms and
1e-4 absolute on parameters (|w| ~ 0.02-1). A TP bug moves them by far more (measured by breaking the code):
every tp rank adding its losses to the (loss, stop) word doubles the loss; a dropout mask drawn for the local
shard's positions moves step 1's loss by 2e-4 relative; tp2 x dp2 without the data-parallel gradient average
moves step 2's loss by 2.6e-3 relative.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
from typing import Any

import pytest
import torch

from tests.conftest import job
from tests.ranks import run_world

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-4
STEPS = 3
MODEL = {"seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 16, "dropout": 0.1}


def _spec(world: int, task: dict[str, Any] | None = None, **parallel: Any) -> dict[str, Any]:
    return job(task={"model": MODEL, "optimizer": {"lr": 3e-3, "warmup_steps": 5}, **(task or {})},
               train={"steps": STEPS, "global_batch": 8, "micro_batch": 2, "audit_samples": True},
               workers={"min": world, "max": world}, parallel=parallel)


def _train(rank: int, world: int, layouts: list[dict[str, Any]], port: int, out: str) -> None:
    """One rank: for each of ``layouts`` (parallel sections, one after another on the same gloo group) the
    worker's StepRunner, seeded init (or ``_load``: the training state from a DCP directory, by name, as a
    checkpoint restore does), ``_steps`` (default STEPS) steps, then (``_save``) its training state saved
    with DCP; rank 0 saves each run's losses, audited sample ids and the gathered whole model (``_digest``:
    and the model digest the driver would combine from every rank's part). ``_task``:
    keys of the job's ``task`` section to set (e.g. another built-in model, tests/test_llama.py); ``_entry``:
    a ``"module:function"`` making the Task (an example's ``make_task``, called with the harness's seq_len)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from elastictrain.config import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    from elastictrain.parallel import optim
    from elastictrain.parallel.digest import combine

    torch.set_num_threads(1)
    norms: list[float] = []  # every clip's pre-clip global norm, as the step loop computes it
    clip = optim.clip_grad_norm
    optim.clip_grad_norm = lambda *a, **k: norms.append(float(n := clip(*a, **k))) or n  # type: ignore[assignment]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = []
    try:
        for parallel in layouts:
            parallel = dict(parallel)
            steps, load, save = parallel.pop("_steps", STEPS), parallel.pop("_load", None), parallel.pop("_save", None)
            llama, meta = parallel.pop("_llama", False), parallel.pop("_meta", False)
            digest, entry = parallel.pop("_digest", False), parallel.pop("_entry", None)
            cfg = build_config(_spec(world, parallel.pop("_task", None), **parallel))
            if llama:  # a model the project did not write, with the plan of examples/tp_llama.py
                from examples.tp_llama import make_task

                task = dataclasses.replace(make_task(seq_len=MODEL["seq_len"]), lr_fn=None)
            elif entry:  # a model the project did not write, through the hooks its example gives
                module, fn = entry.split(":")
                task = dataclasses.replace(getattr(importlib.import_module(module), fn)(seq_len=MODEL["seq_len"]),
                                           lr_fn=None)
            else:
                task = dataclasses.replace(builtin_task(cfg), lr_fn=None)
            runner = StepRunner(task, cfg.train, FaultInjector(()), audit=True, parallel=cfg.parallel)
            if meta:  # what a rank rebuilding its model for a new generation has: no values until a restore
                runner.model = runner._meta_model()
            runner.attach(rank, world, 0, resolve(spec_from_config(cfg), world))
            if load:
                runner.state.load_from(dcp.FileSystemReader(load))
            elif runner.uninitialized:
                runner.init_from_seed()
            norms.clear()
            records = [runner.run_step(False)[0] for _ in range(steps)]
            if save:
                dcp.save(runner.state.state_dict(), checkpoint_id=save)
            full = runner.state.full_model_state()
            parts: list[Any] = [None] * world  # the digest as the driver combines it (parallel/digest.py)
            if digest:
                dist.all_gather_object(parts, runner.digest_part())
            results.append({"losses": [r.loss for r in records], "ids": [sorted(r.sample_ids) for r in records],
                            "tokens_per_expert": [r.tokens_per_expert for r in records],
                            "params": full, "tp_sharded": _tp_sharded(runner.model), "norms": list(norms),
                            "digest": combine(parts) if digest else None})
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _tp_sharded(model: torch.nn.Module) -> list[str]:
    """Names of the parameters sharded on the mesh's ``tp`` axis (proof that a plan was applied)."""
    from torch.distributed.tensor import DTensor

    out = []
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            axis = p.device_mesh.mesh_dim_names.index("tp")
            if p.placements[axis].is_shard():
                out.append(name)
    return out


def _run(tmp_path, world: int, layouts: list) -> list:
    return run_world(_train, tmp_path, world, layouts)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("ref"), 1, [{}])[0]


def _resumed_matches(got: dict[str, Any], ref: dict[str, Any], done: int) -> None:
    """A run resumed after ``done`` steps matches the uninterrupted run's later losses and final model."""
    _matches(got, {"losses": ref["losses"][done:], "ids": ref["ids"][done:], "params": ref["params"],
                   "norms": ref["norms"][done:]})


def _matches(got: dict[str, Any], ref: dict[str, Any]) -> None:
    # as many steps as the reference, and one clipping norm a step on both sides (a zip of empty lists
    # compares nothing: a loop that stopped clipping, or a probe that no longer sees the clip, passed)
    assert len(got["losses"]) == len(ref["losses"]) > 0, (got["losses"], ref["losses"])
    assert len(got["norms"]) == len(got["losses"]) and len(ref["norms"]) == len(ref["losses"]), (
        got["norms"], ref["norms"])
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), 1):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (step, a, b)
    assert got["ids"] == ref["ids"]  # every sample of every step audited once
    # clipping by the norm of the whole model's gradient, summed over tp shards (and stages, dp shards)
    for a, b in zip(got["norms"], ref["norms"], strict=True):
        assert abs(a - b) <= LOSS_RTOL * b, (got["norms"], ref["norms"])
    assert got["params"].keys() == ref["params"].keys()
    for name, t in ref["params"].items():
        assert torch.allclose(got["params"][name], t, rtol=0, atol=PARAM_ATOL), name
    if got["digest"] is not None:  # the digest the ranks combine (parallel/digest.py) is the gathered model's
        from elastictrain.parallel.digest import digest_of

        assert got["digest"] == digest_of(got["params"])


TP2 = [{"tp": 2}, {"tp": 2, "sequence_parallel": False}, {"tp": 2, "_meta": True}]


def test_tp2_with_and_without_sequence_parallel_match_one_process(tmp_path, one_process) -> None:
    """Also from a meta-device model whose seeded values rank 0 broadcasts (load_seeded_init), as a rank
    rebuilding for a new generation at step 0 starts."""
    runs = _run(tmp_path, 2, TP2)
    for got in runs:
        _matches(got, one_process)
    sp, plain, _ = (set(r["tp_sharded"]) for r in runs)
    assert {"tok_emb.weight", "head.weight", "blocks.0.q.weight", "blocks.1.mlp_out.weight"} <= plain
    assert sp == plain | {"pos_emb.weight"}  # sequence parallel splits the positions' rows too


def test_tp2_by_dp2_ddp_fsdp_and_tp2_by_pp2_on_4_match_one_process(tmp_path, one_process) -> None:
    """tp2 x dp2 under ddp (gradients averaged over the data-parallel group by hand) and fsdp (FSDP2 on the
    dp submesh of the 2-D mesh), and tp2 x pp2 (each stage tensor-parallel), on one group of 4."""
    # with the digest (fsdp over a tp-sharded dimension places a _StridedShard, which torch 2.13 does not call
    # is_shard(): the digest once counted those rows twice)
    runs = _run(tmp_path, 4, [{"tp": 2, "_digest": True}, {"tp": 2, "plan": "fsdp", "_digest": True},
                              {"tp": 2, "pp": 2, "_digest": True}])
    for got in runs:
        _matches(got, one_process)


def test_tp2_by_pp2_by_dp2_and_tp2_by_hsdp_on_8_match_one_process(tmp_path, one_process) -> None:
    """tp2 x pp2 x dp2 (ddp in each stage), and tp2 under hsdp (2 replicas x 2 shards x tp2: FSDP2 on the
    2-D data-parallel submesh of a 3-D mesh)."""
    for got in _run(tmp_path, 8, [{"tp": 2, "pp": 2}, {"tp": 2, "plan": "hsdp", "shard_size": 2}]):
        _matches(got, one_process)


def test_checkpoints_reshard_between_tp_pp_and_data_parallel_layouts(tmp_path, one_process) -> None:
    """A training state saved after 2 steps under tp2 x pp2 resumes under fsdp4 and ddp1, and one saved
    under ddp2 resumes under tp2 x pp2, each with the third step and final model of the uninterrupted run
    (DCP reshards by parameter name: TP shards are DTensors with global offsets)."""
    tp_pp, ddp2 = str(tmp_path / "tp2pp2"), str(tmp_path / "ddp2")
    _run(tmp_path, 2, [{"_steps": 2, "_save": ddp2}])
    four = _run(tmp_path, 4, [{"tp": 2, "pp": 2, "_steps": 2, "_save": tp_pp},
                              {"plan": "fsdp", "_load": tp_pp, "_steps": 1},
                              {"tp": 2, "pp": 2, "_load": ddp2, "_steps": 1}])
    (ddp1,) = _run(tmp_path, 1, [{"_load": tp_pp, "_steps": 1}])
    for got in (four[1], four[2], ddp1):
        _resumed_matches(got, one_process, 2)


@pytest.mark.parametrize("sections, needle", [
    ({"parallel": {"tp": 4}, "workers": {"min": 4, "max": 4}, "task": {"model": {"n_head": 2}}},
     "parallel.tp=4 does not divide task.model.n_head=2; valid parallel.tp values for this model: [1, 2]"),
    ({"parallel": {"tp": 2}, "workers": {"min": 3, "max": 3}}, "tp=2 needs a multiple of 2 workers (whole TP groups)"),
    ({"parallel": {"sequence_parallel": True}}, "parallel.sequence_parallel=true needs parallel.tp > 1"),
])
def test_bad_tp_config_names_the_rule_and_the_fix(sections, needle) -> None:
    from elastictrain import ConfigError, build_config

    with pytest.raises(ConfigError) as err:
        build_config(job(**sections))
    assert needle in str(err.value)


def test_bad_tp_config_at_the_cli_is_one_line_exit_2(tmp_path) -> None:
    from tests.test_config import _cli

    proc = _cli(tmp_path, "parallel: {tp: 3}\nworkers: {min: 3, max: 3}\ntrain: {global_batch: 6, micro_batch: 2}\n")
    assert proc.returncode == 2, proc.stderr
    assert "parallel.tp=3 does not divide task.model.n_head=2" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # nothing started


def test_plan_puts_tp_innermost() -> None:
    """The mesh order of the shared design: pp, dp_replicate, dp_shard, tp; tp groups are consecutive ranks."""
    from elastictrain.parallel.layout import LayoutSpec, resolve, valid_world_sizes

    spec = LayoutSpec("hsdp", 16, 1, shard_size=2, pp=2, tp=2)
    layout = resolve(spec, 16)
    assert layout.dims.names == ("pp", "dp_replicate", "dp_shard", "tp") and layout.dims.shape == (2, 2, 2, 2)
    assert [layout.dims.coord(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [(layout.dims.coord(r)["pp"], layout.dims.dp_rank(r)) for r in (0, 1, 2, 7, 8, 15)] == [(0, 0), (0, 0), (0, 1), (0, 3), (1, 0), (1, 3)]
    assert not layout.replicated and layout.sequence_parallel
    assert valid_world_sizes(spec, 40) == [8, 16, 32]
    assert not resolve(LayoutSpec("ddp", 8, 1, tp=2, sequence_parallel=False), 4).sequence_parallel
    plain = resolve(LayoutSpec("ddp", 8, 1), 4)  # without tp every formula is today's
    assert plain.dims.names == ("dp_replicate",) and plain.dims.dp_rank(3) == 3 and plain.replicated


HAS_HF = importlib.util.find_spec("transformers") is not None


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed (pip install 'elastictrain[hf]'): the "
                                       "Hugging Face Llama example cannot be built")
def test_a_hugging_face_llama_runs_tensor_parallel_through_its_parallelize_fn(tmp_path) -> None:
    """examples/tp_llama.py: tp2 of a Llama the project did not write trains the numbers of one process,
    its projections, embedding and head sharded on tp."""
    (ref,) = _run(tmp_path, 1, [{"_llama": True}])
    (tp2,) = _run(tmp_path, 2, [{"_llama": True, "tp": 2, "sequence_parallel": False}])
    _matches(tp2, ref)
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight",
            "model.layers.0.mlp.down_proj.weight"} <= set(tp2["tp_sharded"])


def test_tp2_run_through_the_controller_resumes_under_ddp1(tmp_path, ray_local) -> None:
    """tp2 (sequence parallel) through the real controller on local Ray for 4 steps, with the peer tier every
    step and a durable checkpoint every 2: every step's samples audited once; then ddp1 resumes its step-4
    checkpoint (the framework's own format) to 6 steps with the losses and final model of 6 uninterrupted
    ddp1 steps (trained in this process: tests/parallel_fixtures.py InProcessRun)."""
    def spec(world: int, steps: int, run_id: str, ckpt: bool = True, **parallel: Any) -> dict[str, Any]:
        s = _spec(world, **parallel)
        s["train"] = {**s["train"], "steps": steps}
        s["run_id"] = run_id
        s["checkpoint"] = ({"uri": str(tmp_path / "ckpt"), "every_steps": 2, "memory_every_steps": 1} if ckpt
                           else {"uri": None})
        return s

    from tests.conftest import run_job
    from tests.parallel_fixtures import InProcessRun

    tp = run_job(tmp_path, spec(2, 4, "tp-resume", tp=2), name="tp2")
    assert tp.result.exit_code == 0, tp.summary
    assert [len(e["sample_ids"]) for e in tp.of("step")] == [8] * 4  # 8 samples a step, each counted once
    ddp = run_job(tmp_path, spec(1, 6, "tp-resume"), name="ddp1")
    assert ddp.result.exit_code == 0, ddp.summary
    (resumed,) = ddp.of("resumed")
    assert resumed["step"] == 4
    # 6 uninterrupted ddp1 steps: the worker's step loop on one rank in this process (no worker to start)
    ref = InProcessRun(spec(1, 6, "ref", ckpt=False))
    losses = {**tp.losses(), **ddp.losses()}
    assert sorted(losses) == list(range(1, 7))
    for step, loss in ref.losses().items():
        assert abs(losses[step] - loss) <= LOSS_RTOL * abs(loss), (step, losses[step], loss)
    got, want = ddp.final_params(), ref.final_params()
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= PARAM_ATOL
