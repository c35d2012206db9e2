"""Plan resolution (elastictrain/parallel/plan.py): the one place that says which world sizes a plan can
use, with which mesh and accumulation; the config, the membership policy and the worker all ask it."""

from __future__ import annotations

import pytest

from elastictrain.config import ConfigError, build_config
from elastictrain.controller.policy import decide_membership
from elastictrain.parallel.plan import PlanError, PlanSpec, is_valid, resolve, valid_world_sizes
from tests.conftest import job


def test_ddp_and_fsdp_follow_the_data_rule():
    for plan, axis in (("ddp", "dp_replicate"), ("fsdp", "dp_shard")):
        spec = PlanSpec(plan, global_batch=24, micro_batch=2)
        assert valid_world_sizes(spec, 12) == [1, 2, 3, 4, 6, 12]
        layout = resolve(spec, 3)
        assert layout.accum == 4 and layout.dims.names == (axis,) and layout.dims.shape == (3,)
        assert layout.replicated is (plan == "ddp")


def test_hsdp_needs_whole_shard_groups():
    spec = PlanSpec("hsdp", global_batch=24, micro_batch=2, shard_size=2)
    assert valid_world_sizes(spec, 12) == [2, 4, 6, 12]
    layout = resolve(spec, 4)
    assert (layout.dims.dp_replicate, layout.dims.dp_shard, layout.dims.dp) == (2, 2, 4)
    assert layout.dims.names == ("dp_replicate", "dp_shard") and layout.accum == 3
    ok, why = is_valid(spec, 3)
    assert not ok and "multiple of parallel.shard_size=2" in why
    with pytest.raises(PlanError, match=r"usable world sizes .*: \[2, 4, 6, 12\]"):
        resolve(spec, 3)


def test_data_rule_rejection_names_the_batch():
    with pytest.raises(PlanError, match=r"global_batch=16 is not a multiple .* usable world sizes .*\[1, 2, 4\]"):
        resolve(PlanSpec("fsdp", 16, 4), 3)


def test_config_rejects_worlds_the_plan_cannot_use():
    with pytest.raises(ConfigError, match=r"world size 3 is not usable: hsdp needs a multiple .*valid world "
                                          r"sizes up to workers.max=4: \[2, 4\]"):
        build_config(job(workers={"min": 3, "max": 4}, parallel={"plan": "hsdp"},
                         train={"global_batch": 24, "micro_batch": 2}))
    cfg = build_config(job(workers={"min": 2, "max": 4}, parallel={"plan": "hsdp", "shard_size": 2}))
    assert cfg.parallel.plan == "hsdp"
    with pytest.raises(ConfigError, match="mixed_precision=bf16 needs parallel.plan fsdp or hsdp"):
        build_config(job(parallel={"mixed_precision": "bf16"}))


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
