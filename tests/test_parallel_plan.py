"""Plan resolution (elastictrain/parallel/layout.py): the one place that says which world sizes a plan can
use, with which mesh and accumulation; the config, the membership policy and the worker all ask it."""

from __future__ import annotations

import pytest

from elastictrain.config import ConfigError, build_config
from elastictrain.controller.policy import decide_membership
from elastictrain.parallel.layout import LayoutError, LayoutSpec, is_valid, resolve, valid_world_sizes
from tests.conftest import job


def test_ddp_and_fsdp_follow_the_data_rule():
    for plan, axis in (("ddp", "dp_replicate"), ("fsdp", "dp_shard")):
        spec = LayoutSpec(plan, global_batch=24, micro_batch=2)
        assert valid_world_sizes(spec, 12) == [1, 2, 3, 4, 6, 12]
        layout = resolve(spec, 3)
        assert layout.accum == 4 and layout.dims.names == (axis,) and layout.dims.shape == (3,)
        assert layout.replicated is (plan == "ddp")


def test_hsdp_needs_whole_shard_groups():
    spec = LayoutSpec("hsdp", global_batch=24, micro_batch=2, shard_size=2)
    assert valid_world_sizes(spec, 12) == [2, 4, 6, 12]
    layout = resolve(spec, 4)
    assert (layout.dims.dp_replicate, layout.dims.dp_shard, layout.dims.dp) == (2, 2, 4)
    assert layout.dims.names == ("dp_replicate", "dp_shard") and layout.accum == 3
    ok, why = is_valid(spec, 3)
    assert not ok and "multiple of parallel.shard_size=2" in why
    with pytest.raises(LayoutError, match=r"usable world sizes .*: \[2, 4, 6, 12\]"):
        resolve(spec, 3)


def test_data_rule_rejection_names_the_batch():
    with pytest.raises(LayoutError, match=r"global_batch=16 is not a multiple .* usable world sizes .*\[1, 2, 4\]"):
        resolve(LayoutSpec("fsdp", 16, 4), 3)


def test_config_rejects_worlds_the_plan_cannot_use():
    with pytest.raises(ConfigError, match=r"world size 3 is not usable: hsdp needs a multiple .*valid world "
                                          r"sizes up to workers.max=4: \[2, 4\]"):
        build_config(job(workers={"min": 3, "max": 4}, parallel={"plan": "hsdp"},
                         train={"global_batch": 24, "micro_batch": 2}))
    cfg = build_config(job(workers={"min": 2, "max": 4}, parallel={"plan": "hsdp", "shard_size": 2}))
    assert cfg.parallel.plan == "hsdp"


def test_bf16_is_accepted_under_every_plan():
    """bf16 without FSDP autocasts the forward (parallel/precision.py): plain ddp, ddp x pp and ddp x tp
    build, as fsdp does (tests/test_bf16_ddp.py trains them)."""
    for parallel in ({}, {"pp": 2}, {"tp": 2}, {"plan": "fsdp"}):
        cfg = build_config(job(workers={"min": 2, "max": 2}, task={"model": {"n_layer": 2}},
                               parallel={**parallel, "mixed_precision": "bf16"}))
        assert cfg.parallel.mixed_precision == "bf16"


def test_membership_picks_the_largest_world_the_plan_can_use():
    common = dict(current=4, mode="elastic", min_workers=1, max_workers=4, global_batch=24, micro_batch=2,
                  waiting_since=None, now=0.0, wait_limit_s=10.0)
    # 3 workers left: ddp/fsdp keep 3; hsdp (groups of 2) re-plans to one group fewer.
    assert decide_membership(available=3, **common).world_size == 3
    assert decide_membership(available=3, plan="fsdp", **common).world_size == 3
    hsdp = decide_membership(available=3, plan="hsdp", shard_size=2, **common)
    assert (hsdp.action, hsdp.world_size) == ("go", 2)
    waiting = decide_membership(available=1, plan="hsdp", shard_size=2, **common)
    assert waiting.action == "wait" and waiting.world_size == 2


# ------------------------------------------------------------------------------------------ pipeline (pp)
def test_pp_is_an_outer_factor_of_the_mesh():
    spec = LayoutSpec("ddp", global_batch=16, micro_batch=2, pp=2)
    assert valid_world_sizes(spec, 8) == [2, 4, 8]  # whole pipelines; D = W/2 must divide 16/2
    layout = resolve(spec, 4)
    assert layout.dims.names == ("pp", "dp_replicate") and layout.dims.shape == (2, 2)
    assert (layout.dims.dp, layout.accum, layout.n_stages, layout.stages_per_rank) == (2, 4, 2, 1)
    assert [(layout.dims.coord(r)["pp"], layout.dims.dp_rank(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert not layout.replicated  # a stage rank never holds the whole model
    hsdp = resolve(LayoutSpec("hsdp", 16, 2, shard_size=2, pp=2), 8)
    assert hsdp.dims.names == ("pp", "dp_replicate", "dp_shard") and hsdp.dims.shape == (2, 2, 2)
    assert [(hsdp.dims.coord(r)["pp"], hsdp.dims.dp_rank(r)) for r in (3, 4, 7)] == [(0, 3), (1, 0), (1, 3)]
    assert resolve(LayoutSpec("ddp", 16, 2), 4).dims.names == ("dp_replicate",)  # pp=1: mesh unchanged
    with pytest.raises(LayoutError, match=r"pp=2 needs a multiple of 2 workers .*usable world sizes .*pp=2 \(1f1b\): "
                                        r"\[2, 4, 8\]"):
        resolve(spec, 3)


def test_schedule_rules_on_micro_batches_are_plan_rules():
    # 1f1b: n_microbatches >= pp. G=8, m=2: D=1 -> 4 micro-batches, D=2 -> 2, D=4 -> 1 (< pp=2)
    assert valid_world_sizes(LayoutSpec("ddp", 8, 2, pp=2, pp_schedule="1f1b"), 8) == [2, 4]
    assert valid_world_sizes(LayoutSpec("ddp", 8, 2, pp=2, pp_schedule="gpipe"), 8) == [2, 4, 8]
    ok, why = is_valid(LayoutSpec("ddp", 8, 2, pp=2), 8)
    assert not ok and "at least pp=2 micro-batches per step, got 1" in why
    # interleaved / zero bubble: n % max(1, n // pp) == 0. G=10, m=1, pp=2: D=1 -> 10 ok, D=2 -> 5 (rounds 2): no
    for sched in ("interleaved_1f1b", "zero_bubble"):
        spec = LayoutSpec("ddp", 10, 1, pp=2, pp_schedule=sched)
        assert valid_world_sizes(spec, 20) == [2, 10, 20], sched
        ok, why = is_valid(spec, 4)
        assert not ok and "multiple of its rounds" in why
        assert resolve(spec, 2).stages_per_rank == 2 and resolve(spec, 2).n_stages == 4
    assert valid_world_sizes(LayoutSpec("ddp", 10, 1, pp=2, pp_schedule="zbv"), 20) == [2, 4, 10, 20]


def test_pp_config_errors_list_what_is_valid():
    with pytest.raises(ConfigError, match=r"parallel.pp_schedule: Input should be 'gpipe', '1f1b', "
                                          r"'interleaved_1f1b', 'zero_bubble' or 'zbv'"):
        build_config(job(parallel={"pp": 2, "pp_schedule": "dualpipe"}))
    with pytest.raises(ConfigError, match=r"zbv runs exactly 2 stages per rank .* got parallel.stages_per_rank=3"):
        build_config(job(parallel={"pp": 2, "pp_schedule": "zbv", "stages_per_rank": 3}))
    with pytest.raises(ConfigError, match=r"1f1b runs exactly 1 stage per rank"):
        build_config(job(parallel={"pp": 2, "stages_per_rank": 2}))
    with pytest.raises(ConfigError, match=r"task.model.n_layer=1 blocks cannot fill 4 pipeline stages .*raise "
                                          r"n_layer to >= 4"):
        build_config(job(parallel={"pp": 2, "pp_schedule": "interleaved_1f1b"}, workers={"min": 2, "max": 2}))
    with pytest.raises(ConfigError, match=r"world size 3 is not usable: pp=2 needs a multiple of 2 workers"):
        build_config(job(parallel={"pp": 2}, workers={"min": 2, "max": 3}))
    cfg = build_config(job(parallel={"pp": 2, "pp_schedule": "zbv"}, workers={"min": 2, "max": 4},
                           task={"model": {"n_layer": 4}}))
    assert (cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.parallel.stages_per_rank) == (2, "zbv", None)


def test_membership_keeps_whole_pipelines():
    spec = LayoutSpec("ddp", 16, 2, pp=2)
    got = decide_membership(available=3, current=4, mode="elastic", min_workers=1, max_workers=4, global_batch=16,
                            micro_batch=2, waiting_since=None, now=0.0, wait_limit_s=10.0, spec=spec)
    assert (got.action, got.world_size) == ("go", 2)
