"""Expert parallel composed with HSDP (ep x hsdp, issue 39), on 4 real gloo processes.

hsdp 2x2 x ep2 (dp_replicate 2, dp_shard 2 = ep: efsdp 1) and hsdp 1x4 x ep2 (efsdp 2): the experts sharded
over the ep group inside the shard axis, HSDP over ``(dp_replicate, efsdp)``, the dense part HSDP over the
data mesh, wired as the step loop does it (``attach_expert_parallel`` then the default ``parallelize``).
Three SGD steps with the framework's clip, each of two micro-batches (the first under
``ParallelModel.accumulating``: HSDP's replica all-reduce deferred): every step's per-sample losses, the
clipped gradient norm and, after each step, every parameter (gathered whole) equal the one-process run's AND
the ddp ep2 x dp2 run's (the same 4 ranks, the same data: the ddp path's gradient scale). Each rank holds
``1 / (ep x efsdp)`` of every expert tensor, replicated over ``dp_replicate``. The hsdp x ep state saved by
DCP loads by name into one process's model.

Tolerance: tests/test_expert_parallel.py's (float32 atol 1e-6 / rtol 1e-5): the same per-row math, with the
gradient sums in another order (reduce-scatter and all-reduce instead of one all-reduce).

Against broken builds (run before trusting it): the experts' FSDP over the ``efsdp`` axis alone (the replica
mesh's last dim, no HSDP: replicas never summed): the share rule fails (mesh ``(efsdp, ep)``) and, without it,
the 2x2 run's step-0 clipped norm differs ("Scalars are not close"); gloo's forced SUM kept at efsdp 1
(``edp.size() > 1`` instead of the shard dim's size: torch divides twice): the 2x2 run's step-0 norm differs;
the divide factor left at FSDP's default (no ``set_gradient_divide_factor``): the 2x2 run's step-0 norm
differs.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import pytest
import torch

from tests.checkpoint_fixtures import free_port
from tests.ep_checks import assert_loads_into_one_process, step_and_match
from tests.ranks import run_ranks
from tests.test_expert_parallel import ATOL, RTOL, _build, _data, _losses

STEPS, EP, BATCH, WORLD = 3, 2, 8, 4
MAX_NORM = 0.05  # clips at every step (the norms are ~0.2-0.6): the norm over every shard matters


def _hsdp(replicate: int, cpu: torch.device):
    """An hsdp (replicate x WORLD/replicate) x ep2 model and its wrapper, as the step loop builds them."""
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain.config import ParallelConfig
    from elastictrain.parallel.dims import MeshDims
    from elastictrain.parallel.expert_wiring import attach_expert_parallel
    from elastictrain.parallel.parallelize import parallelize, wrap

    shard = WORLD // replicate
    model = _build("gpt")
    ep = attach_expert_parallel(model, MeshDims(dp_replicate=replicate, dp_shard=shard, plan="hsdp", ep=EP), cpu)
    assert ep is not None and ep.fsdp
    assert ep.mesh.mesh_dim_names == ("dp_replicate", "efsdp", "ep")
    assert tuple(ep.mesh.shape) == (replicate, shard // EP, EP)
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    module = parallelize(model, mesh, ParallelConfig(plan="hsdp", shard_size=shard))
    return model, ep, wrap(module, mesh)


def _layouts(rank: int, port: int, ckpt: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain.config import ParallelConfig
    from elastictrain.models.gpt import GPT
    from elastictrain.parallel import optim
    from elastictrain.parallel.dims import MeshDims
    from elastictrain.parallel.expert import expert_parameter_names
    from elastictrain.parallel.expert_wiring import attach_expert_parallel
    from elastictrain.parallel.parallelize import ParallelModel, parallelize_ddp
    from tests.test_expert_parallel import _GPT

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        cpu = torch.device("cpu")
        ref = _build("gpt")
        # ddp ep2 x dp2: the path whose gradient scale hsdp must equal
        ddp_model = _build("gpt")
        ddp_ep = attach_expert_parallel(ddp_model, MeshDims(dp_replicate=WORLD, ep=EP), cpu)
        ddp = ParallelModel(parallelize_ddp(ddp_model, init_device_mesh("cpu", (WORLD,), mesh_dim_names=(
            "dp_replicate",)), ParallelConfig()), None)
        runs = {"ddp": (ddp_model, ddp_ep, ddp)}
        for replicate in (2, 1):
            runs[f"hsdp{replicate}x{WORLD // replicate}"] = _hsdp(replicate, cpu)
        for name in ("hsdp2x2", "hsdp1x4"):
            _share_rule(runs[name][0], expert_parameter_names(runs[name][0]), replicate=int(name[4]))
        opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9, foreach=False)
                for m in (ref, *(r[0] for r in runs.values()))]
        per = BATCH // WORLD
        mine = slice(per * rank, per * rank + per)
        for step in range(STEPS):
            inputs, targets = _data(BATCH * (step + 1))
            inputs, targets = inputs[-BATCH:], targets[-BATCH:]
            ref_losses = _losses(ref, inputs, targets)
            ref_losses.mean().backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, foreach=False)
            assert float(want) > MAX_NORM, float(want)
            for name, (model, ep, pm) in runs.items():
                got_losses = []
                for k in range(per):  # one sample per micro-batch; the first accumulates
                    one = slice(mine.start + k, mine.start + k + 1)
                    with pm.accumulating() if k < per - 1 else contextlib.nullcontext():
                        losses = _losses(pm.module, inputs[one], targets[one])
                        (losses.sum() * WORLD / BATCH).backward()  # the step loop's scale: sum x D / G
                    got_losses.append(losses.detach())
                torch.testing.assert_close(torch.cat(got_losses), ref_losses[mine], atol=ATOL, rtol=RTOL,
                                           msg=lambda m, s=step, n=name: f"{n} step {s} losses: {m}")
                ep.reduce_grads(model)
                got = optim.clip_grad_norm(pm.module.parameters(), MAX_NORM, foreach=False)
                torch.testing.assert_close(got, want, atol=0, rtol=RTOL,
                                           msg=lambda m, s=step, n=name: f"{n} step {s} grad norm: {m}")
            step_and_match(opts, {n: r[0] for n, r in runs.items()}, ref, step)
        # the hsdp x ep state by name: DCP's (replicate, efsdp, ep) expert shards load into one process's model
        dcp.save(runs["hsdp2x2"][0].state_dict(), checkpoint_id=ckpt)
        dist.barrier()
        if rank == 0:
            assert_loads_into_one_process(ckpt, GPT(_GPT).state_dict(), ref)  # (a fresh seed-less build)
    finally:
        dist.destroy_process_group()


def _share_rule(model: torch.nn.Module, experts: list[str], replicate: int) -> None:
    """Every expert tensor: this rank holds 1 / (ep x efsdp) of it, the same part as its replicas."""
    from torch.distributed.tensor import Replicate

    params = dict(model.named_parameters())
    for name in experts:
        p = params[name]
        assert p.to_local().numel() * (WORLD // replicate) == p.numel(), (name, p.placements, p.to_local().shape)
        assert p.device_mesh.mesh_dim_names == ("dp_replicate", "efsdp", "ep"), (name, p.device_mesh)
        assert isinstance(p.placements[0], Replicate), p.placements


def test_hsdp_ep2_equals_ddp_ep2_and_one_process(tmp_path) -> None:
    """hsdp 2x2 x ep2 (efsdp 1) and hsdp 1x4 x ep2 (efsdp 2) in the same 4 processes."""
    run_ranks(_layouts, (free_port(), str(tmp_path / "ckpt")), nprocs=WORLD)


# ------------------------------------------------------------------ the step loop (StepRunner, no Ray)

LOOP_TASK = {"model": {"seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32, "dropout": 0.0,
                       "moe": {"experts": 4, "top_k": 2, "aux_coef": 0.5}},
             "optimizer": {"lr": 3e-3, "warmup_steps": 2}}
LOOP_TRAIN = {"steps": 3, "seed": 0, "global_batch": 8, "micro_batch": 1, "log_every": 100}


def loop_spec(world: int, **parallel: object) -> dict:
    """A tiny MoE GPT job of ``world`` workers (micro-batch 1: two micro-batches per step at 4 data ranks)."""
    from tests.conftest import job

    return job(task=LOOP_TASK, train=LOOP_TRAIN, workers={"min": world, "max": world}, parallel=parallel)


def _loop_rank(rank: int, port: int, spec: dict, out: str) -> None:
    """The worker's StepRunner on rank ``rank`` of a gloo group: attach, the seeded init, every step; writes
    the losses, the token counts, the digest part and (rank 0) the whole final model to ``out``."""
    import torch.distributed as dist

    from elastictrain import build_config
    from tests.ranks import attached_runner, join_gloo

    cfg = build_config(spec)
    world = cfg.workers.max
    join_gloo(rank, world, port, timeout_s=60)
    try:
        runner = attached_runner(cfg, rank, world)
        records = [runner.run_step(False)[0] for _ in range(cfg.train.steps)]
        state = runner.state.full_model_state()
        torch.save({"losses": {r.step: r.loss for r in records}, "mesh": records[0].mesh,
                    "tokens": [r.tokens_per_expert for r in records], "seen": [sorted(r.sample_ids) for r in records],
                    "digest": runner.digest_part(), "state": state}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def assert_loop_equals_one_process(tmp_path, spec: dict, mesh: str) -> None:
    """``spec`` on 4 gloo processes through the step loop: every step's loss, the token counts, the sample
    audit, the final parameters and the model digest equal one process's (tests/parallel_fixtures.py)."""
    from elastictrain.parallel.digest import combine, digest_of
    from tests.parallel_fixtures import LOSS_RTOL, PARAM_ATOL, InProcessRun

    out = str(tmp_path / "loop")
    run_ranks(_loop_rank, (free_port(), spec, out), nprocs=WORLD)
    got = [torch.load(f"{out}.{r}", weights_only=False) for r in range(WORLD)]
    ref = InProcessRun(loop_spec(1))
    assert got[0]["mesh"] == mesh, got[0]["mesh"]
    for step, want in ref.losses().items():
        assert abs(got[0]["losses"][step] - want) <= LOSS_RTOL * abs(want), (step, got[0]["losses"], ref.losses())
    slots = LOOP_TRAIN["global_batch"] * LOOP_TASK["model"]["seq_len"] * 2
    assert all(sum(c) == slots for t in got[0]["tokens"] for c in t.values()), got[0]["tokens"]
    seen = [i for step in got[0]["seen"] for i in step]  # the audit: each sample of a step once, no repeats
    assert len(seen) == len(set(seen)) == 3 * LOOP_TRAIN["global_batch"], got[0]["seen"]
    want_state = ref.final_params()
    worst = max(((got[0]["state"][k].double() - v.double()).abs().max().item(), k) for k, v in want_state.items())
    assert worst[0] <= PARAM_ATOL, worst
    # every element counted once by exactly one rank (the digest's coverage rule), and the whole is rank 0's
    assert combine([g["digest"] for g in got]) == digest_of(got[0]["state"])


def test_hsdp2x2_ep2_step_loop_equals_one_process(tmp_path) -> None:
    """The worker's StepRunner under hsdp 2x2 x ep2 (two micro-batches a step: HSDP's replica all-reduce
    deferred for the first). Against a broken build (gloo's forced SUM kept at efsdp 1: the expert gradients
    divided twice): final blocks.0.moe.w_in off by 3.9e-4 > 1e-5."""
    assert_loop_equals_one_process(tmp_path, loop_spec(WORLD, plan="hsdp", shard_size=2, ep=2),
                                   "hsdp: dp_replicate=2 x dp_shard=2")


def test_hsdp_ep_groups_stay_inside_a_replica() -> None:
    """Pure: under hsdp an ep group is inside one replica (ep divides dp_shard), the expert mesh is
    ``(dp_replicate, efsdp, ep)``; an ep that would cross replicas is refused naming the valid values."""
    from elastictrain.parallel.dims import MeshDims
    from elastictrain.parallel.expert_wiring import ep_mesh_layout
    from elastictrain.parallel.layout import LayoutSpec, is_valid

    dims = MeshDims(dp_replicate=2, dp_shard=4, plan="hsdp", ep=2)
    assert ep_mesh_layout(dims) == ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ("dp_replicate", "efsdp", "ep"))
    assert ep_mesh_layout(MeshDims(dp_replicate=4, ep=2))[1] == ("edp", "ep")
    ok, why = is_valid(LayoutSpec("hsdp", 8, 1, shard_size=2, ep=4), 4)
    assert not ok and "parallel.ep=4 under hsdp must divide parallel.shard_size=2" in why and "[1, 2]" in why
    try:
        MeshDims(dp_replicate=2, dp_shard=2, plan="hsdp", ep=4)
    except ValueError as e:
        assert "must divide dp_shard x cp x tp = 2 under hsdp" in str(e)
    else:
        raise AssertionError("an ep group across replicas was accepted")


def test_hsdp_ep_recovery_coverage_by_replica() -> None:
    """Pure: under hsdp 2x2 x ep2 a rank's replica (other dp_replicate, same shard and ep coordinate) holds
    its part: losing rank 1 is covered by rank 3 (a peer restore); losing both of them is not."""
    from elastictrain.controller.sources import rank_sources
    from elastictrain.parallel.dims import MeshDims

    dims = MeshDims(dp_replicate=2, dp_shard=2, plan="hsdp", ep=2)
    assert dims.holder_key(1) == dims.holder_key(3) != dims.holder_key(0)

    def decide(survivors, memory=None):
        return rank_sources(dp_replicate=2, dp_shard=2, survivors=survivors, memory=memory or {}, durable_step=2,
                            last_step=5, dims=dims)

    got = decide({0: 5, 2: 5, 3: 5})
    assert got.chosen.kind == "peer" and got.lost_steps == 0, got.reason
    assert decide({0: 5, 2: 5}, {5: True}).chosen.kind == "memory"


@pytest.mark.slow
def test_hsdp2x2_ep2_rank_killed_recovers_from_its_replica(tmp_path, ray_local) -> None:
    """hsdp 2x2 x ep2 on 4 real Ray workers (replicas {0, 1} and {2, 3}; ranks 1 and 3 hold the same dense
    shard and experts), the peer tier every step: rank 1 is SIGKILLed mid-step with no spare. Rank 3 holds
    rank 1's part, so the survivors serve every part of the state (source peer, lost steps <= 1); the 3 left
    shrink to one replica (hsdp 1x2 x ep2) and the run finishes with every step's loss (a redone one too)
    and the final parameters of the uninterrupted one-process run, each step's samples seen once. Against a
    build whose ``holder_keys`` lists the product of the axes (keys no rank has under hsdp x ep): the
    recovery comes from the peer tier (source ``memory``), not the replica."""
    from tests.conftest import run_job
    from tests.parallel_fixtures import RECOVERY_PARAM_ATOL, InProcessRun, assert_same_numbers
    from tests.test_ep_wiring import _audited, _spec
    from tests.test_pp_recovery import TIMEOUTS, _slow

    steps = 8
    kill = {"rank": 1, "step": 5, "point": "mid_step", "kind": "kill"}
    spec = _spec(4, steps, "ep-hsdp-kill", ep=2, plan="hsdp", shard_size=2)
    spec.update(workers={**spec["workers"], "min": 2}, faults=_slow(4) + [kill], timeouts=dict(TIMEOUTS),
                recovery={"min_workers_wait_s": 240}, checkpoint={**spec["checkpoint"], "memory_every_steps": 1})
    run = run_job(tmp_path, spec, name="hsdp2x2ep2kill")
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 1)], run.of("failure")
    rec = run.of("recovered")[0]
    assert rec["source"] == "peer" and rec["lost_steps"] <= 1, rec
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in run.of("resized")]
    assert sizes[0] == (4, 2), sizes
    meshes = [e["mesh"] for e in run.of("step") if e.get("mesh")]
    assert meshes[0].startswith("hsdp") and meshes[-1].startswith("hsdp"), meshes
    _audited(run, steps)
    assert_same_numbers(run, InProcessRun(_spec(1, steps)), param_atol=RECOVERY_PARAM_ATOL)


def test_planner_prices_ep_x_hsdp() -> None:
    """Pure: under hsdp 2x4 x ep2 a rank keeps ``1 / (ep x efsdp) = 1 / dp_shard`` of the experts' state (as
    of the dense part), the expert unit is gathered over ``efsdp = dp_shard / ep`` ranks, and its reduced shard
    is all-reduced across the 2 replicas; ``--all-axes`` marks hsdp x ep runnable. Against broken builds: the
    expert unit's group left at the data size ``dp // ep`` (4, not efsdp 2): the group check fails; the
    experts' replica all-reduce not priced: the dp_replicate bytes fall short of hsdp's without ep."""
    from elastictrain.planner import GIB, Candidate, Cluster, Training
    from elastictrain.planner.memory import rank_params, state_params
    from elastictrain.planner.search import is_runnable, runnable_axes
    from elastictrain.planner.steptime import collective_calls, moved_bytes
    from tests.test_planner_ep import GPU, MOE

    train = Training(global_batch=32, micro_batch=2)
    cl = Cluster(nodes=1, devices_per_node=8, **GPU)
    c = Candidate(dp_replicate=2, dp_shard=4, ep=2, micro_batch=2)
    assert c.layout_name == "hsdp" and is_runnable(c, runnable_axes())
    dense = rank_params(MOE, c) - MOE.expert_params / 2
    assert state_params(MOE, c) == pytest.approx(dense / 4 + MOE.expert_params / 4)
    m, moe = train.global_batch // (8 * 2), MOE.moe_layers
    groups = collective_calls(MOE, train, cl, c).groups
    assert ("fsdp", m * 2 * moe, 2, 1) in groups, groups  # the expert unit gathered over efsdp = 4 / 2
    assert ("fsdp", m * 2 * moe, 4, 3) in groups, groups  # the router unit over the shard group
    assert [g for g in groups if g[0] == "replicate" and g[1] == moe and g[2] == 2], groups  # experts across replicas
    replicated = moved_bytes(MOE, train, cl, c)["dp_replicate"]
    plain = moved_bytes(MOE, train, cl, Candidate(dp_replicate=2, dp_shard=4, micro_batch=2))["dp_replicate"]
    # each rank all-reduces its 1 / dp_shard of the dense part and of the experts (1/ep over efsdp) across the
    # replicas: the same bytes as hsdp without ep (without the experts' all-reduce it would be less)
    assert replicated == pytest.approx(plain)
