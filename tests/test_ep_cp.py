"""Expert parallel composed with context parallel, and a mixture-of-experts model under cp (issue 39), on 4
real gloo processes.

cp2 x dp2 with the experts replicated (the load-balancing loss's statistics summed over cp), cp2 x dp2 x ep2
(each ep group IS a cp group: its two ranks hold the two halves of the same samples), cp2 x dp2 x ep4 (one
ep group over every rank: dp and cp), cp2 x fsdp2 x ep2 (the experts FSDP-sharded over their edp replicas,
the dense part over ``dp_shard x cp``) and cp2 x hsdp 2x1 x ep2 (the experts HSDP over ``(dp_replicate,
efsdp)``, the dense part over ``(dp_replicate, dp_shard_cp)``), wired as the step loop does it (``attach_expert_parallel``,
``build_mesh``, the default ``parallelize``, the cp group set on the model, each micro-batch cut by
``shard_sequence``). Three SGD steps with the framework's clip: every step's per-sample losses (language model
plus load balance: the whole sample's on each cp rank), the clipped gradient norm and, after each step,
every parameter (gathered whole) equal the one-process run's; the per-expert token counts summed over the
ranks are one process's.

The model's ``aux_coef`` is 0.5 (not 0.01): the load-balancing term then moves the losses and the router's
gradients far beyond the tolerance when it is wrong.

Tolerance: tests/test_expert_parallel.py's (float32 atol 1e-6 / rtol 1e-5): the same per-token math; the
attention merges key blocks by log-sum-exp (parallel/blockwise.py) and the sums run in another order.

Against broken builds (run before trusting it): the load-balance statistics not summed over cp (each rank's
own positions as if they were the sample): cp2xdp2's step-0 losses differ; summed but with the one-rank
gradient (no ``cp_grad_scale``): cp2xdp2's step-0 clipped norm differs; the expert gradient scale 1 / D instead
of 1 / (D x cp): cp2xdp2xep2's step-0 norm differs; ``expert_rank`` without cp (the data rank alone: the two cp
ranks of a data rank would hold the same experts and no group would span cp): the expert mesh is built wrong
(torch's DeviceMesh raises: it does not hold this rank).
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import pytest
import torch

from tests.checkpoint_fixtures import free_port
from tests.ep_checks import step_and_match
from tests.ranks import run_ranks
from tests.test_expert_parallel import _GPT, ATOL, RTOL, _data

STEPS, BATCH, WORLD, CP = 3, 8, 4, 2
MAX_NORM = 0.05
CFG = dataclasses.replace(_GPT, moe=dataclasses.replace(_GPT.moe, aux_coef=0.5))


def _build() -> torch.nn.Module:
    from elastictrain.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(CFG)


def _loss(module: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, cp_rank: int | None) -> torch.Tensor:
    from elastictrain.parallel.context import shard_sequence
    from elastictrain.task import _gpt_loss

    batch = {"input": inputs, "target": targets}
    if cp_rank is not None:
        batch = shard_sequence(batch, CP, cp_rank)
    return _gpt_loss(module, batch, torch.zeros(len(inputs), dtype=torch.int64))


def _layout(dims, rank: int):
    """(model, ExpertParallel or None, wrapped module) of ``dims`` on this rank, as ``StepRunner.attach``."""
    from elastictrain.config import ParallelConfig
    from elastictrain.parallel.context import enable_context_parallel
    from elastictrain.parallel.expert_wiring import attach_expert_parallel
    from elastictrain.parallel.mesh import build_mesh
    from elastictrain.parallel.parallelize import parallelize

    cpu = torch.device("cpu")
    model = _build()
    ep = attach_expert_parallel(model, dims, cpu)
    mesh = build_mesh(dims, cpu)
    module = parallelize(model, mesh, ParallelConfig(plan=dims.plan, cp=dims.cp, ep=dims.ep,
                                                     shard_size=dims.dp_shard if dims.plan == "hsdp" else None))
    enable_context_parallel(model, mesh["cp"].get_group())
    return model, ep, module


def _layouts(rank: int, port: int) -> None:
    import torch.distributed as dist

    from elastictrain.models.moe import moe_token_counts
    from elastictrain.parallel import optim
    from elastictrain.parallel.dims import MeshDims

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        ref = _build()
        layouts = {
            "cp2xdp2": MeshDims(dp_replicate=2, cp=CP),
            "cp2xdp2xep2": MeshDims(dp_replicate=2, cp=CP, ep=2),
            "cp2xdp2xep4": MeshDims(dp_replicate=2, cp=CP, ep=4),
            "cp2xfsdp2xep2": MeshDims(dp_shard=2, cp=CP, ep=2, plan="fsdp"),
            "cp2xhsdp2x1xep2": MeshDims(dp_replicate=2, dp_shard=1, cp=CP, ep=2, plan="hsdp"),
        }
        runs = {name: _layout(dims, rank) for name, dims in layouts.items()}
        assert runs["cp2xdp2xep2"][1].ep_mesh.mesh.tolist() == [2 * (rank // 2), 2 * (rank // 2) + 1]  # a cp group
        opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9, foreach=False)
                for m in (ref, *(r[0] for r in runs.values()))]
        dp_rank, cp_rank = layouts["cp2xdp2"].dp_rank(rank), layouts["cp2xdp2"].coord(rank)["cp"]
        per = BATCH // 2
        mine = slice(per * dp_rank, per * dp_rank + per)
        for step in range(STEPS):
            inputs, targets = _data(BATCH * (step + 1))
            inputs, targets = inputs[-BATCH:], targets[-BATCH:]
            ref_losses = _loss(ref, inputs, targets, None)
            ref_counts = torch.stack(list(moe_token_counts(ref).values()))
            ref_losses.mean().backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, foreach=False)
            assert float(want) > MAX_NORM, float(want)
            for name, (model, ep, module) in runs.items():
                losses = _loss(module, inputs[mine], targets[mine], cp_rank)
                torch.testing.assert_close(losses, ref_losses[mine], atol=ATOL, rtol=RTOL,
                                           msg=lambda m, s=step, n=name: f"{n} step {s} losses: {m}")
                counts = torch.stack(list(moe_token_counts(model).values()))
                dist.all_reduce(counts)  # the step event's counts: summed over every rank (dp and cp)
                assert torch.equal(counts, ref_counts), (name, step, counts, ref_counts)
                (losses.sum() * 2 / BATCH).backward()  # the step loop's scale: sum x D / G (D without cp)
                if ep is not None:
                    ep.reduce_grads(model)
                got = optim.clip_grad_norm(module.parameters(), MAX_NORM, foreach=False)
                torch.testing.assert_close(got, want, atol=0, rtol=RTOL,
                                           msg=lambda m, s=step, n=name: f"{n} step {s} grad norm: {m}")
            step_and_match(opts, {n: r[0] for n, r in runs.items()}, ref, step)
    finally:
        dist.destroy_process_group()


def test_ep_x_cp_and_moe_under_cp_equal_one_process() -> None:
    run_ranks(_layouts, (free_port(),), nprocs=WORLD)


@pytest.mark.parametrize("plan, mesh", [("ddp", "ddp: dp_replicate=2 x cp=2"),
                                        ("hsdp", "hsdp: dp_replicate=2 x dp_shard=1 x cp=2")])
def test_cp2_x_dp2_x_ep2_step_loop_equals_one_process(tmp_path, plan, mesh) -> None:
    """The worker's StepRunner under cp2 x dp2 x ep2 (ddp, and hsdp 2x1: the experts HSDP over
    (dp_replicate, efsdp = 1 x 2 / 2); each ep group a cp group), as
    tests/test_ep_hsdp.py's hsdp loop: every step's loss, token counts, audit, final parameters, digest.
    Against broken builds: the load-balance statistics not summed over cp: step 1's loss 6.06081 against
    6.05989; the digest's first ep group taken by data rank (``dp_rank // ep``, not ``expert_rank``): the experts
    counted twice ("blocks.0.moe.b_in has 512 elements but the ranks counted 1024"); an expert DTensor not
    spanning cp in the digest: counted half."""
    from tests.test_ep_hsdp import assert_loop_equals_one_process, loop_spec

    hsdp = {"shard_size": 1} if plan == "hsdp" else {}
    assert_loop_equals_one_process(tmp_path, loop_spec(WORLD, cp=CP, ep=2, plan=plan, **hsdp), mesh)


def test_ep_groups_factor_the_data_x_cp_ranks() -> None:
    """Pure: ep numbers the data x cp ranks ``dp_rank x cp + cp`` (torchtitan's ``dp_shard x cp = efsdp x ep``):
    ep2 under cp2 x dp2 groups each data rank's two cp ranks; ep4 spans both; the layout lists valid ep."""
    from elastictrain.parallel.dims import MeshDims
    from elastictrain.parallel.layout import LayoutSpec, is_valid

    dims = MeshDims(dp_replicate=2, cp=2, ep=2)
    assert [dims.expert_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert [dims.ep_group_ranks(r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [dims.expert_replica_ranks(r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert MeshDims(dp_replicate=2, cp=2, ep=4).ep_group_ranks(3) == [0, 1, 2, 3]
    tp = MeshDims(dp_shard=2, cp=2, tp=2, plan="fsdp", ep=2)  # (pure: the rank order with tp innermost)
    assert tp.ep_group_ranks(5) == [4, 5] and tp.expert_replica_ranks(0) == [0, 2, 4, 6]  # (tp ranks join too)
    ok, why = is_valid(LayoutSpec("ddp", 8, 1, cp=2, ep=4), 4)  # 2 data ranks x cp2: ep4 factors them
    assert ok, why
    ok, why = is_valid(LayoutSpec("ddp", 6, 1, cp=2, ep=4), 6)
    assert not ok and "parallel.ep=4 does not divide the data-parallel size 3 x cp=2" in why and "[1, 2, 3, 6]" in why


def test_cp_ep_recovery_coverage_by_expert_replica() -> None:
    """Pure: under cp2 x dp2 x ep2 (ddp) rank 1 (data rank 0, cp 1: experts of ep coordinate 1) is covered by
    rank 3 (data rank 1, cp 1: the same experts); under ep4 every rank holds other experts: no peer covers."""
    from elastictrain.controller.sources import rank_sources
    from elastictrain.parallel.dims import MeshDims

    def decide(dims, survivors):
        return rank_sources(dp_replicate=2, dp_shard=1, survivors=survivors, memory={}, durable_step=2,
                            last_step=5, dims=dims)

    ep2 = MeshDims(dp_replicate=2, cp=2, ep=2)
    assert [ep2.ep_coord(r) for r in range(4)] == [0, 1, 0, 1]
    assert decide(ep2, {0: 5, 2: 5, 3: 5}).chosen.kind == "peer"
    assert decide(MeshDims(dp_replicate=2, cp=2, ep=4), {0: 5, 2: 5, 3: 5}).chosen.kind == "checkpoint"


def test_planner_prices_ep_x_cp() -> None:
    """Pure: under cp2 a rank routes half its samples' tokens (the all-to-all bytes halve), the experts'
    replicas are ``dp x cp / ep``, and an MoE model's cp candidates are searched (runnable under every plan,
    with tp and pp too). Against a broken build (tokens not divided by cp): the volume does not halve."""
    import pytest

    from elastictrain.planner import Candidate, Cluster, Training, rank_layouts
    from elastictrain.planner.steptime import collective_calls, ep_bytes
    from tests.test_planner_ep import GPU, MOE

    train = Training(global_batch=32, micro_batch=2)
    cl = Cluster(nodes=1, devices_per_node=8, **GPU)
    assert ep_bytes(MOE, train, Candidate(dp_replicate=2, cp=2, ep=2, micro_batch=2)) == pytest.approx(
        ep_bytes(MOE, train, Candidate(dp_replicate=2, ep=2, micro_batch=2)) / 2)
    groups = collective_calls(MOE, train, cl, Candidate(dp_replicate=2, cp=2, ep=2, micro_batch=2)).groups
    assert [g for g in groups if g[0] == "replicate" and g[2] == 2], groups  # experts over dp x cp / ep = 2 replicas
    ranked = rank_layouts(MOE, train, cl, runnable_only=False)
    cp_ep = [e for e in ranked if e.candidate.cp > 1 and e.candidate.ep > 1]
    assert cp_ep and all(e.runnable == (e.candidate.ep % e.candidate.tp == 0) for e in cp_ep)  # (with tp and pp too)
