"""The mesh as data (elastictrain/parallel/dims.py): coordinates, role queries, expert-parallel groups, the
one whole-state predicate, and plan resolution / config rules for the cp and ep axes."""

from __future__ import annotations

import itertools

import pytest

from elastictrain.config import ConfigError, build_config
from elastictrain.parallel.dims import AXES, MeshDims
from elastictrain.parallel.layout import LayoutSpec, cp_rule, resolve, valid_world_sizes
from tests.conftest import job

SIZES = (1, 2, 3)


def _every_dims():
    for pp, rep, shard, cp, tp in itertools.product(SIZES, (1, 2), (1, 2), (1, 2), (1, 2)):
        plan = "ddp" if shard == 1 else "fsdp" if rep == 1 else "hsdp"
        yield MeshDims(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, cp=cp, plan=plan)


def test_coord_and_rank_round_trip_row_major_over_every_axis_combination():
    for dims in _every_dims():
        seen = []
        for r in range(dims.world_size):
            c = dims.coord(r)
            assert list(c) == list(AXES) and dims.rank(c) == r
            seen.append(tuple(c[n] for n in AXES))
        # row-major, outermost first: the coordinates in rank order are the product in axis order
        assert seen == list(itertools.product(*(range(dims.size(n)) for n in AXES))), dims


def test_group_ranks_vary_only_the_named_axes():
    dims = MeshDims(pp=2, dp_replicate=2, dp_shard=1, cp=2, tp=2, plan="ddp")
    assert dims.world_size == 16 and dims.coord(13) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1}
    assert dims.group_ranks(13, ("tp",)) == [12, 13]           # tp innermost: consecutive
    assert dims.group_ranks(13, ("cp", "tp")) == [12, 13, 14, 15]
    assert dims.group_ranks(13, ("pp",)) == [5, 13]
    assert dims.group_ranks(13, ()) == [13]
    assert dims.group_ranks(13, ("dp_replicate", "dp_shard")) == [9, 13]
    assert dims.dp_rank(13) == 1 and dims.dp == 2
    with pytest.raises(ValueError, match="unknown mesh axes"):
        dims.group_ranks(0, ("ep",))
    with pytest.raises(ValueError, match="outside the mesh of 16"):
        dims.coord(16)
    with pytest.raises(ValueError, match="cp=2 is outside the axis of size 2"):
        dims.rank({"cp": 2})


def test_role_queries():
    fsdp = MeshDims(dp_shard=4, cp=2, tp=2, plan="fsdp")
    assert fsdp.state_shard_axes == ("dp_shard", "cp")  # torchtitan: FSDP shards over dp_shard x cp
    assert fsdp.replicate_axes == ("dp_replicate",)
    assert (fsdp.batch_axes, fsdp.seq_axes, fsdp.model_axes) == (("dp_replicate", "dp_shard"), ("cp",), ("pp", "tp"))
    ddp = MeshDims(dp_replicate=4, cp=2, plan="ddp")
    assert ddp.state_shard_axes == () and ddp.replicate_axes == ("dp_replicate", "dp_shard", "cp")
    # the DeviceMesh keeps the plan's data axes always, pp/cp/tp only when > 1
    assert fsdp.names == ("dp_shard", "cp", "tp") and fsdp.shape == (4, 2, 2)
    assert MeshDims(dp_replicate=2, dp_shard=2, pp=2, plan="hsdp").names == ("pp", "dp_replicate", "dp_shard")
    assert fsdp.holder_axes() == ("pp", "tp", "dp_shard", "cp")
    assert len(fsdp.holder_keys()) == 16 and len(ddp.holder_keys()) == 1


def test_holds_whole_state_is_one_predicate():
    """Only plain replicas hold the whole state: no pp, no tp, no FSDP (DTensors even on a shard axis of
    size 1). Before, Layout.replicated said yes for fsdp at dp_shard=1 (and hsdp at shard_size=1) while the
    gatherer, the step loop and the wrapper said no."""
    assert MeshDims(dp_replicate=4, plan="ddp").holds_whole_state
    assert MeshDims(dp_replicate=4, cp=2, plan="ddp").holds_whole_state  # cp ranks hold replicas under ddp
    for dims in (MeshDims(dp_shard=1, plan="fsdp"), MeshDims(dp_replicate=4, dp_shard=1, plan="hsdp"),
                 MeshDims(dp_replicate=2, pp=2), MeshDims(dp_replicate=2, tp=2), MeshDims(dp_shard=2, plan="fsdp")):
        assert not dims.holds_whole_state, dims


def test_every_whole_state_question_agrees():
    """The controller (Layout.replicated), the source gatherer (_split) and the step loop's runner answer
    the same for every plan at every world size; fsdp at world 1 and hsdp at shard_size 1 disagreed."""
    from elastictrain.controller.gather import _split

    for plan, shard, pp, tp in itertools.product(("ddp", "fsdp", "hsdp"), (1, 2), (1, 2), (1, 2)):
        spec = LayoutSpec(plan, global_batch=16, micro_batch=1, shard_size=shard, pp=pp, tp=tp, pp_schedule="gpipe")
        for w in valid_world_sizes(spec, 8):
            layout = resolve(spec, w)
            assert layout.replicated is layout.dims.holds_whole_state is (not _split(layout)), (plan, shard, w)
            assert layout.replicated is (plan == "ddp" and pp == tp == 1), (plan, shard, pp, tp, w)


def test_a_one_rank_fsdp_runner_is_not_a_replica():
    """A real one-rank gloo group under fsdp (dp_shard = 1): the runner holds DTensors, and every whole-state
    answer says so (before: Layout.replicated True, the runner False)."""
    import torch.distributed as dist

    from elastictrain.parallel.parallelize import _has_dtensor
    from elastictrain.parallel.layout import spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    cfg = build_config(job(workers={"min": 1, "max": 1}, parallel={"plan": "fsdp"}))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runner = StepRunner(builtin_task(cfg), cfg.train, FaultInjector(()), parallel=cfg.parallel)
        layout = resolve(spec_from_config(cfg), 1)
        runner.attach(0, 1, 0, layout)
        assert _has_dtensor(runner.model)
        assert runner.replicated is layout.replicated is False
    finally:
        dist.destroy_process_group()


def test_expert_parallel_groups_factor_the_data_ranks():
    dims = MeshDims(dp_replicate=2, dp_shard=2, pp=2, plan="hsdp", ep=2)
    assert dims.world_size == 8  # ep is not a world axis
    # stage 0 holds ranks 0..3 (data ranks 0..3); ep groups are consecutive data ranks
    assert [dims.ep_coord(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert dims.ep_group_ranks(2) == [2, 3] and dims.ep_group_ranks(5) == [4, 5]
    assert dims.expert_replica_ranks(1) == [1, 3] and dims.expert_replica_ranks(6) == [4, 6]
    for r in range(8):  # an ep group times the expert replicas is the stage's data ranks
        stage = dims.group_ranks(r, dims.batch_axes)
        assert set(dims.ep_group_ranks(r)) | set(dims.expert_replica_ranks(r)) <= set(stage)
        assert len(dims.ep_group_ranks(r)) * len(dims.expert_replica_ranks(r)) == len(stage)
    with pytest.raises(ValueError, match="ep=3 must divide the data-parallel size 4"):
        MeshDims(dp_replicate=4, ep=3)


def test_cp_is_a_world_axis_and_shrinks_in_whole_blocks():
    spec = LayoutSpec("fsdp", global_batch=8, micro_batch=1, cp=2, tp=2)
    assert valid_world_sizes(spec, 40) == [4, 8, 16, 32]  # whole pp x cp x tp blocks; D divides 8
    layout = resolve(spec, 16)
    assert layout.dims.names == ("dp_shard", "cp", "tp") and layout.dims.shape == (4, 2, 2)
    assert layout.accum == 2 and not layout.replicated
    with pytest.raises(Exception, match=r"cp=2 x tp=2 needs a multiple of 4 workers \(whole CP groups of whole "
                                        r"TP groups\), got 6.*usable world sizes \(1..64\) for parallel.plan=fsdp, "
                                        r"cp=2, tp=2: \[4, 8, 16, 32\]"):
        resolve(spec, 6)


def test_ep_must_divide_the_data_ranks():
    spec = LayoutSpec("ddp", global_batch=12, micro_batch=1, ep=2)
    assert valid_world_sizes(spec, 12) == [2, 4, 6, 12]
    with pytest.raises(Exception, match=r"parallel.ep=2 does not divide the data-parallel size 3 .*valid "
                                        r"parallel.ep values there: \[1, 3\].*\[2, 4, 6, 12\]"):
        resolve(spec, 3)


def test_cp_config_errors_name_the_valid_values():
    assert cp_rule(2, 64) is None and cp_rule(1, 63) is None
    assert "valid parallel.cp values for it: [1, 3, 7, 21]" in cp_rule(2, 42)
    assert "valid parallel.cp values for it: [1, 2, 3, 4, 6, 12]" in cp_rule(5, 24)
    with pytest.raises(ConfigError, match=r"parallel.cp=3 needs the sequence length to be a multiple of 2 x cp = 6"
                                          r".*task.model.seq_len=32; valid parallel.cp values for it: "
                                          r"\[1, 2, 4, 8, 16\]"):
        build_config(job(workers={"min": 3, "max": 3}, train={"global_batch": 6, "micro_batch": 2},
                         parallel={"cp": 3}))
    with pytest.raises(ConfigError, match=r"world size 3 is not usable: cp=2 needs a multiple of 2 workers"):
        build_config(job(workers={"min": 3, "max": 4}, parallel={"cp": 2}))


def test_cp_and_ep_are_wired_no_axis_is_refused_as_unwired():
    """Both axes run in the step loop now (tests/test_cp_wiring.py, tests/test_ep_wiring.py): a config with
    either builds (ep with its mixture-of-experts model), and nothing says "not wired"."""
    assert build_config(job(workers={"min": 2, "max": 2}, parallel={"cp": 2})).parallel.cp == 2
    moe = job(workers={"min": 2, "max": 2}, parallel={"ep": 2})
    moe["task"]["model"] = {**moe["task"]["model"], "moe": {"experts": 4, "top_k": 2}}
    assert build_config(moe).parallel.ep == 2


def test_placement_keeps_a_cp_x_tp_group_on_one_node():
    from elastictrain.parallel.placement import place, unit_size

    dims = MeshDims(dp_replicate=2, cp=2, tp=2, plan="ddp")
    assert unit_size(dims) == 4
    got = place([("a", 2), ("b", 4), ("c", 2)], dims)  # the 4-slot node takes one group whole
    assert got.nodes[:4] == ("b",) * 4 and len(got.warnings) == 1 and "CP x TP group of ranks 4-7" in got.warnings[0]
    assert "parallel.cp=2 x parallel.tp=2" in got.warnings[0]


def test_recovery_coverage_is_by_coordinate_on_the_shard_axes():
    """Under fsdp the state is sharded over dp_shard x cp: a survivor covers only its own (dp_shard, cp)
    coordinate; under ddp a cp rank is a replica."""
    from elastictrain.controller.sources import rank_sources

    fsdp = MeshDims(dp_shard=2, cp=2, plan="fsdp")  # ranks: (shard, cp) = 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1)
    lost = rank_sources(dp_replicate=1, dp_shard=1, dims=fsdp, survivors={0: 4, 1: 4, 2: 4}, memory={},
                        durable_step=None, last_step=4)
    assert lost.chosen.kind == "scratch" and "lack (shard coordinate, cp coordinate) [(1, 1)] of 2 x 2" in lost.reason
    ddp = MeshDims(dp_replicate=2, cp=2, plan="ddp")
    kept = rank_sources(dp_replicate=1, dp_shard=1, dims=ddp, survivors={3: 4}, memory={}, durable_step=None,
                        last_step=4)
    assert kept.chosen.kind == "peer" and kept.chosen.ranks == (3,)
