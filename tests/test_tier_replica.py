"""The peer tier's start-time warning (issue 36 item 4) under ep: whether a layout has a replica of every part
of its state is the mesh's answer (holder keys held twice), not ``dp_replicate > 1``. Pure: no process."""

from __future__ import annotations

import pytest

from elastictrain.checkpoint.tier_budget import size_budget, tier_shortfall

GIB = 1 << 30


@pytest.mark.parametrize("plan,shard,pp,tp,ep,world,replicated", [
    # ep: the experts of an ep coordinate have a replica only when the expert ranks span several ep groups
    ("ddp", 1, 1, 1, 2, 2, False),  # dp_replicate 2, one ep group: each rank's experts exist once
    ("ddp", 1, 2, 1, 2, 4, False),  # pp2 x dp2 x ep2: dp_replicate 2, still one ep group per stage
    ("ddp", 1, 1, 1, 2, 4, True),  # two ep groups: every expert coordinate twice
    ("ddp", 1, 2, 1, 2, 8, True),
    ("ddp", 1, 1, 2, 2, 4, True),  # dp2 x tp2: 4 expert ranks, two ep groups
    ("hsdp", 2, 1, 1, 2, 4, True),  # ep inside each replica: the other replica holds the same experts
    ("fsdp", 1, 1, 1, 2, 4, False),
    # without ep the answer is dp_replicate > 1's
    ("ddp", 1, 1, 1, 1, 4, True), ("hsdp", 2, 1, 1, 1, 4, True), ("fsdp", 1, 1, 1, 1, 4, False),
    ("ddp", 1, 2, 1, 1, 2, False), ("ddp", 1, 1, 2, 1, 4, True),
])
def test_a_replica_means_every_part_of_the_state_twice(plan, shard, pp, tp, ep, world, replicated) -> None:
    """``every_part_replicated`` (controller/gather.py) per layout, and what the start-time check says with a
    budget too small for one step: a warning exactly where some part has no replica. Before (the check
    given ``dp_replicate > 1``), ddp x ep2 on 2 ranks and pp2 x dp2 x ep2 on 4 counted as replicated and the
    warning was not given (shown by putting that rule back into ``every_part_replicated``: those two cases
    fail)."""
    from elastictrain.controller.gather import every_part_replicated
    from elastictrain.parallel.layout import LayoutSpec, resolve

    layout = resolve(LayoutSpec(plan, global_batch=16, micro_batch=1, shard_size=shard, pp=pp, tp=tp, ep=ep,
                                pp_schedule="gpipe"), world)
    assert every_part_replicated(layout) is replicated
    small = size_budget(4_800_000_000, world=world, ranks_per_node=world, node_free_bytes=GIB, configured_gib=None)
    why = tier_shortfall(small, 4_800_000_000 // world, world, has_replica=every_part_replicated(layout),
                         periodic_checkpoint=False)
    assert (why is None) is replicated, why
    if why:
        assert "no replica" in why and "checkpoint.memory_budget_gib" in why
