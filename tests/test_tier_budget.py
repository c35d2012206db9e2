"""The peer memory tier sized from the job (issue 36 item 4): the pure sizing rule, and a run whose tier
cannot keep a lost shard says so at start (an event and one console line naming the fix)."""

from __future__ import annotations

import io

import pytest

from elastictrain.checkpoint.tier_budget import size_budget, tier_shortfall
from tests.conftest import job

GIB = 1 << 30


def test_the_default_budget_is_the_jobs_need_capped_by_free_memory() -> None:
    # 400M parameters' fp32 state with Adam (4.8 GB) on 8 ranks, 4 per node: a keeper keeps 2 steps of 4 ranks
    tier = size_budget(4_800_000_000, world=8, ranks_per_node=4, node_free_bytes=64 * GIB, configured_gib=None)
    assert tier.budget == tier.need == int(2 * 600_000_000 * 4 * 1.1)  # 5.28 GB: over the old 4 GiB default
    assert tier_shortfall(tier, 600_000_000, 4, has_replica=False, periodic_checkpoint=False) is None
    small = size_budget(4_800_000_000, world=8, ranks_per_node=4, node_free_bytes=4 * GIB, configured_gib=None)
    assert small.budget == 2 * GIB and "free host memory" in small.reason
    why = tier_shortfall(small, 600_000_000, 4, has_replica=False, periodic_checkpoint=False)
    assert why and "checkpoint.memory_budget_gib" in why and "checkpoint.every_steps" in why
    # a replica or a periodic checkpoint covers the loss: nothing to say
    assert tier_shortfall(small, 600_000_000, 4, has_replica=True, periodic_checkpoint=False) is None
    assert tier_shortfall(small, 600_000_000, 4, has_replica=False, periodic_checkpoint=True) is None
    given = size_budget(4_800_000_000, 8, 4, 64 * GIB, configured_gib=0.5)
    assert given.budget == GIB // 2 and given.reason == "checkpoint.memory_budget_gib"


@pytest.mark.parametrize("plan,shard,pp,tp,world,parts", [
    ("ddp", 1, 1, 1, 4, 1), ("fsdp", 1, 1, 1, 4, 4), ("hsdp", 2, 1, 1, 4, 2), ("ddp", 1, 2, 1, 4, 2),
    ("ddp", 1, 1, 2, 4, 2), ("fsdp", 1, 2, 2, 8, 8), ("hsdp", 2, 2, 1, 8, 4)])
def test_one_snapshot_of_each_part_fits_the_sized_budget(plan, shard, pp, tp, world, parts) -> None:
    """One rank per part of the state sends snapshots (replicas would send the same bytes again), and the
    keeper's default budget holds what those ranks of one node send. Before: every DDP rank sent the whole
    state against a budget sized for state / world, so a 4-rank node's keeper evicted on every snapshot."""
    from elastictrain.controller.gather import snapshot_pushers
    from elastictrain.parallel.layout import LayoutSpec, resolve

    layout = resolve(LayoutSpec(plan, global_batch=16, micro_batch=1, shard_size=shard, pp=pp, tp=tp,
                              pp_schedule="gpipe"), world)
    pushers = snapshot_pushers(layout)
    assert len(pushers) == parts == len(set(map(layout.dims.holder_key, range(world))))
    assert {layout.dims.holder_key(r) for r in pushers} == set(layout.dims.holder_keys())
    assert min(pushers) == 0
    state = 4_800_000_000
    per_part = state // parts  # what each pusher sends (equal parts)
    on_node = len(pushers)  # every rank on one node: the worst case for its keeper
    tier = size_budget(state, world=len(pushers), ranks_per_node=on_node, node_free_bytes=None, configured_gib=None)
    assert tier.budget >= 2 * per_part * on_node  # KEEP_PER_RANK = 2 snapshots of each pusher fit


@pytest.mark.parametrize("plan,pp,world,parts", [("ddp", 2, 4, 2), ("ddp", 1, 4, 1), ("fsdp", 1, 4, 4)])
def test_under_ep_the_budget_holds_snapshots_that_carry_their_dense_part_whole(plan, pp, world, parts) -> None:
    """Under ep every expert coordinate pushes a snapshot, and each carries its dense part whole (replicated
    over the ep group): a snapshot is dense / dense parts + its experts, not state / pushers. The budget is
    sized by the dense parts. Before (sized by the pushers): pp2 x dp2 x ep2's keeper held one step of the four
    pushers, evicted on every snapshot, and a killed rank's step was found incomplete (restart from 0)."""
    from elastictrain.controller.gather import dense_parts, snapshot_pushers
    from elastictrain.parallel.layout import LayoutSpec, resolve

    layout = resolve(LayoutSpec(plan, global_batch=16, micro_batch=1, pp=pp, ep=2, pp_schedule="gpipe"), world)
    pushers = snapshot_pushers(layout)
    assert dense_parts(layout) == parts
    state, dense_share = 4_800_000_000, 0.8  # a small MoE: most of the state is dense
    dense, experts = state * dense_share, state * (1 - dense_share)
    snapshot = dense / parts + experts / len(pushers)  # the largest a pusher sends (experts split evenly)
    tier = size_budget(state, world=dense_parts(layout), ranks_per_node=len(pushers), node_free_bytes=None,
                       configured_gib=None)
    assert tier.budget >= 2 * snapshot * len(pushers)  # KEEP_PER_RANK = 2 snapshots of each pusher fit


@pytest.mark.slow
def test_a_tier_too_small_for_the_layout_is_said_at_start(tmp_path, ray_local) -> None:
    from elastictrain import build_config
    from elastictrain.trainer import Trainer
    from tests.conftest import Run

    spec = job(train={"steps": 2}, workers={"min": 2, "max": 2}, parallel={"plan": "fsdp"},
               checkpoint={"memory_every_steps": 1, "memory_budget_gib": 1e-6})  # ~1 KB per node
    console = io.StringIO()
    run = Run(Trainer(build_config(spec), run_dir=tmp_path / "short", console=console).fit())
    assert run.result.exit_code == 0
    (short,) = run.of("peer_tier_short")
    assert short["budget_bytes"] == int(1e-6 * GIB) and short["need_bytes"] > short["budget_bytes"]
    assert "raise checkpoint.memory_budget_gib" in short["reason"]
    first_step = next(i for i, e in enumerate(run.events) if e["event"] == "step")
    assert run.events.index(short) < first_step  # at start, not at the first failure
    lines = [line for line in console.getvalue().splitlines() if "peer_tier_short" in line]
    assert len(lines) == 1 and "checkpoint.memory_budget_gib" in lines[0]
