"""Expert parallel composed with FSDP (ep x fsdp, issue 39), on 4 (and 2) real gloo processes.

fsdp4 x ep2 (edp 2; and fsdp2 x ep2, edp 1, what a shrink from 4 leaves): experts sharded over the ep group and FSDP-sharded over their replicas (the edp ranks),
the dense part FSDP-sharded over all 4 data ranks, wired as the step loop does it
(``attach_expert_parallel`` then the default ``parallelize``). Three SGD steps with the framework's clip: every
step's per-sample losses, the clipped gradient norm and, after each step, every parameter (gathered whole)
equal the one-process run's AND the ddp ep2 x dp2 run's (the same 4 ranks, the same data). Each rank holds
``1 / (ep x edp)`` of every expert tensor (the share rule). The fsdp x ep state saved by DCP loads by name into
one process's model, and one process's state loads by name into a fresh fsdp x ep model (the state-dict
keys and the DCP resharding of the 2-D expert placements, both ways).

Tolerance: tests/test_expert_parallel.py's (float32 atol 1e-6 / rtol 1e-5): the same per-row math, with the
gradient sums in another order (reduce-scatter instead of all-reduce; the expert matmuls over the same rows).

Against broken builds (run before trusting it): gloo's forced SUM kept at edp 1 (torch divides twice there):
fsdp2xep2's step-0 clipped norm differs; the expert gradients divided by edp (FSDP's default) instead
of D (``set_gradient_divide_factor`` removed from ``shard_experts``): the clipped norm of step 0 differs
("Scalars are not close": the expert part 2x); the experts FSDP-sharded over all data ranks (the dp mesh
instead of edp): ``fully_shard`` fails at setup ("Cannot concatenate overlapping meshes").
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from tests.checkpoint_fixtures import free_port
from tests.ep_checks import assert_loads_into_one_process, gathered, step_and_match
from tests.ranks import run_ranks
from tests.test_expert_parallel import ATOL, RTOL, _build, _data, _losses

STEPS, EP, BATCH = 3, 2, 8
MAX_NORM = 0.05  # clips at every step (the norms are ~0.2-0.6): the norm over every shard matters


def _layouts(rank: int, port: int, ckpt: str, world: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from elastictrain.config import ParallelConfig
    from elastictrain.models.gpt import GPT
    from elastictrain.parallel import optim
    from elastictrain.parallel.dims import MeshDims
    from elastictrain.parallel.expert import expert_parameter_names
    from elastictrain.parallel.expert_wiring import attach_expert_parallel
    from elastictrain.parallel.parallelize import parallelize, parallelize_ddp
    from tests.test_expert_parallel import _GPT

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        cpu = torch.device("cpu")
        ref = _build("gpt")
        # ddp ep2 x dp2: experts hidden from DDP, reduced by ExpertParallel.reduce_grads
        ddp_model = _build("gpt")
        ddp_ep = attach_expert_parallel(ddp_model, MeshDims(dp_replicate=world, ep=EP), cpu)
        ddp = parallelize_ddp(ddp_model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp_replicate",)),
                              ParallelConfig())
        # fsdp4 x ep2: experts FSDP-sharded over edp, the rest over all 4 data ranks
        f_model = _build("gpt")
        f_ep = attach_expert_parallel(f_model, MeshDims(dp_shard=world, plan="fsdp", ep=EP), cpu)
        assert f_ep is not None and f_ep.fsdp and ddp_ep is not None and not ddp_ep.fsdp
        fsdp = parallelize(f_model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)),
                           ParallelConfig(plan="fsdp"))
        _share_rule(f_model, expert_parameter_names(f_model), world)
        opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9, foreach=False) for m in (ref, ddp, fsdp)]
        per = BATCH // world
        mine = slice(per * rank, per * rank + per)
        for step in range(STEPS):
            inputs, targets = _data(BATCH * (step + 1))
            inputs, targets = inputs[-BATCH:], targets[-BATCH:]
            ref_losses = _losses(ref, inputs, targets)
            ref_losses.mean().backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, foreach=False)
            assert float(want) > MAX_NORM, float(want)
            for name, module, ep in (("ddp", ddp, ddp_ep), ("fsdp", fsdp, f_ep)):
                losses = _losses(module, inputs[mine], targets[mine])
                torch.testing.assert_close(losses, ref_losses[mine], atol=ATOL, rtol=RTOL,
                                           msg=lambda m, s=step, n=name: f"{n} step {s} losses: {m}")
                # the step loop's scale: this rank's per-sample loss sum x D / G (the wrapper averages over D)
                (losses.sum() * world / BATCH).backward()
                ep.reduce_grads(ddp_model if name == "ddp" else f_model)
                got = optim.clip_grad_norm(module.parameters(), MAX_NORM, foreach=False)
                torch.testing.assert_close(got, want, atol=0, rtol=RTOL,
                                           msg=lambda m, s=step, n=name: f"{n} step {s} grad norm: {m}")
            step_and_match(opts, {"ddp": ddp_model, "fsdp": f_model}, ref, step)
        # the fsdp x ep state by name: DCP's 2-D expert shards load into one process's model
        dcp.save(f_model.state_dict(), checkpoint_id=ckpt)
        dist.barrier()
        if rank == 0:
            assert_loads_into_one_process(ckpt, GPT(_GPT).state_dict(), ref)  # (a fresh seed-less build)
        assert all(isinstance(p, DTensor) for p in f_model.parameters())
        # and back: one process's state (DCP, no process group) into a fresh fsdp x ep build of other values
        whole = f"{ckpt}-whole"
        if rank == 0:
            dcp.save(ref.state_dict(), checkpoint_id=whole, no_dist=True)
        dist.barrier()
        torch.manual_seed(3)
        fresh = GPT(_GPT)
        attach_expert_parallel(fresh, MeshDims(dp_shard=world, plan="fsdp", ep=EP), cpu)
        parallelize(fresh, init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)), ParallelConfig(plan="fsdp"))
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=whole)
        fresh.load_state_dict(state)
        for k, v in gathered(fresh).items():
            torch.testing.assert_close(v, ref.state_dict()[k], atol=0, rtol=0, msg=lambda m, k=k: f"{k} resharded: {m}")
    finally:
        dist.destroy_process_group()


def _share_rule(model: torch.nn.Module, experts: list[str], world: int) -> None:
    """Every expert tensor: this rank holds 1 / (ep x edp) of it (ep by expert, FSDP within)."""
    params = dict(model.named_parameters())
    for name in experts:
        p = params[name]
        assert p.to_local().numel() * world == p.numel(), (name, p.placements, p.to_local().shape, p.shape)
        assert p.device_mesh.mesh_dim_names == ("edp", "ep"), (name, p.device_mesh)


@pytest.mark.parametrize("world", [4, 2], ids=["fsdp4xep2", "fsdp2xep2"])
def test_fsdp_ep2_equals_ddp_ep2_and_one_process(tmp_path, world) -> None:
    """fsdp4 x ep2 (edp 2) and fsdp2 x ep2 (edp 1: what a shrink from 4 leaves, where FSDP's expert unit
    reduces over one rank)."""
    run_ranks(_layouts, (free_port(), str(tmp_path / "ckpt"), world), nprocs=world)
