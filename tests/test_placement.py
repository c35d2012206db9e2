"""Placement by topology (parallel/placement.py): TP groups inside a node, pipeline stages across nodes
before data-parallel replicas, a warning only when no placement keeps a TP group whole."""

from __future__ import annotations

import itertools

import pytest

from elastictrain.parallel.placement import PlacementError, node_slots, order_members, place
from elastictrain.parallel.layout import MeshDims


def dims(tp: int = 1, dp: int = 1, pp: int = 1) -> MeshDims:
    return MeshDims(dp_replicate=dp, tp=tp, pp=pp)


def test_tp2_dp2_on_two_nodes_of_two_puts_each_tp_group_on_one_node() -> None:
    got = place([("a", 2), ("b", 2)], dims(tp=2, dp=2))
    assert got.nodes == ("a", "a", "b", "b") and got.warnings == ()
    # members interleaved by Ray's bundles (a, b, a, b): ranks 0,1 go to the two members on a
    assert order_members(["a", "b", "a", "b"], got) == [0, 2, 1, 3]
    assert order_members(["a", "a", "b", "b"], got) == [0, 1, 2, 3]  # already placed: ranks kept


def test_pp2_tp2_on_two_nodes_puts_a_tp_group_per_node_and_the_stages_across_nodes() -> None:
    got = place([("a", 2), ("b", 2)], dims(tp=2, pp=2))
    assert got.nodes == ("a", "a", "b", "b") and got.warnings == ()
    assert "stage 0 on ['a'], stage 1 on ['b']" in got.reason


def test_stages_spread_across_nodes_before_data_parallel_replicas() -> None:
    # pp2 x dp2 on 2 nodes of 2: each stage's replicas share a node, the cut is between the stages
    assert place([("a", 2), ("b", 2)], dims(dp=2, pp=2)).nodes == ("a", "a", "b", "b")
    # spare room: each stage still gets a node of its own (a has room for both)
    assert place([("a", 4), ("b", 4)], dims(dp=2, pp=2)).nodes == ("a", "a", "b", "b")
    # pp2 x dp2 x tp2 on 2 nodes of 4: a stage per node; on 4 nodes of 2: a TP group per node, stages apart
    assert place([("a", 4), ("b", 4)], dims(tp=2, dp=2, pp=2)).nodes == tuple("aaaabbbb")
    four = place([(n, 2) for n in "abcd"], dims(tp=2, dp=2, pp=2))
    assert four.nodes == tuple("aabbccdd") and four.warnings == ()
    # uneven nodes: no node holds a stage of 3, no node holds two stages
    uneven = place([("a", 2), ("b", 2), ("c", 1), ("d", 1)], dims(dp=3, pp=2))
    assert uneven.nodes == ("a", "a", "c", "b", "b", "d")


def test_impossible_layouts_warn_for_each_tp_group_that_spans() -> None:
    got = place([("a", 3), ("b", 1)], dims(tp=2, dp=2))
    assert got.nodes == ("a", "a", "a", "b") and len(got.warnings) == 1
    assert got.warnings[0].startswith("TP group of ranks 2-3 spans nodes ['a', 'b']: no node has 2 free slots")
    assert "parallel.tp=2" in got.warnings[0]
    wide = place([("a", 2), ("b", 2)], dims(tp=4))
    assert wide.nodes == ("a", "a", "b", "b") and len(wide.warnings) == 1 and "ranks 0-3" in wide.warnings[0]
    assert "1 TP group(s) span nodes" in wide.reason


def test_bad_input_is_refused_with_the_rule() -> None:
    with pytest.raises(PlacementError, match="4 ranks do not fit on 2 node"):
        place([("a", 2), ("b", 1)], dims(tp=2, dp=2))
    with pytest.raises(PlacementError, match="unique"):
        place([("a", 2), ("a", 2)], dims(tp=2))
    with pytest.raises(PlacementError, match="ints >= 0"):
        place([("a", -1), ("b", 4)], dims(tp=2))
    with pytest.raises(PlacementError, match="do not match"):
        order_members(["a", "a", "a", "b"], place([("a", 2), ("b", 2)], dims(tp=2, dp=2)))


def test_one_node_keeps_the_given_rank_order() -> None:
    got = place(node_slots(["a"] * 8), dims(tp=2, dp=2, pp=2))
    assert got.nodes == ("a",) * 8 and order_members(["a"] * 8, got) == list(range(8))
    assert node_slots(["b", "a", "b"]) == [("b", 2), ("a", 1)]


@pytest.mark.parametrize("tp,dp,pp", [(t, d, p) for t in (1, 2, 4) for d in (1, 2, 3) for p in (1, 2, 3)])
def test_invariants_over_many_shapes(tp: int, dp: int, pp: int) -> None:
    """Every shape on every node list of up to 4 nodes of 0..6 slots that holds it: each node holds at
    most its slots, a warning exactly for each TP group no whole-group placement could keep on one node,
    every other TP group on one node, and a stage per node whenever the nodes are whole stages."""
    d = dims(tp=tp, dp=dp, pp=pp)
    world = d.world_size
    for n in range(1, 5):
        for slots in itertools.product(range(7), repeat=n):
            if sum(slots) < world:
                continue
            nodes = [(f"n{i}", s) for i, s in enumerate(slots)]
            got = place(nodes, d)
            assert len(got.nodes) == world
            assert all(got.nodes.count(f"n{i}") <= s for i, s in enumerate(slots))
            groups = [set(got.nodes[u * tp:(u + 1) * tp]) for u in range(world // tp)]
            spanning = sum(len(g) > 1 for g in groups)
            assert spanning == len(got.warnings) == max(0, world // tp - sum(s // tp for s in slots))
            if all(s == dp * tp for s in slots) and n >= pp:  # nodes of one stage each: one stage per node
                per = dp * tp
                assert all(len(set(got.nodes[p * per:(p + 1) * per])) == 1 for p in range(pp))
                assert len({got.nodes[p * per] for p in range(pp)}) == pp
            members = list(got.nodes[::-1])
            order = order_members(members, got)
            assert sorted(order) == list(range(world)) and [members[i] for i in order] == list(got.nodes)


def test_arrange_places_only_a_mesh_with_tp_or_pp_and_known_nodes() -> None:
    from elastictrain.parallel.placement import arrange

    order, got = arrange(["a", "b", "a", "b"], dims(tp=2, dp=2))
    assert order == [0, 2, 1, 3] and got is not None and got.nodes == ("a", "a", "b", "b")
    assert arrange(["a", "b", "a", "b"], dims(dp=4)) == ([0, 1, 2, 3], None)  # ddp: rank order as chosen
    assert arrange(["a", None, "a", "b"], dims(tp=2, dp=2)) == ([0, 1, 2, 3], None)  # a node unknown
    # stage 0 on b, where rank 0 is; member 2 keeps rank 2 on a
    assert arrange(["b", "a", "a", "b"], dims(pp=2, dp=2))[0] == [0, 3, 2, 1]


def test_hsdp_shard_groups_are_placed_like_tp_groups_one_node_each() -> None:
    """Issue 36: an hsdp mesh's shard groups (dp_shard consecutive ranks: FSDP's collectives every block)
    were never placed by node, so after a re-formation with members interleaved across nodes each shard group
    spanned both nodes for the rest of the run. Now a shard group is a unit like a TP group."""
    from elastictrain.parallel.placement import arrange

    hsdp = MeshDims(dp_replicate=2, dp_shard=2, plan="hsdp")
    order, got = arrange(["a", "b", "a", "b"], hsdp)
    assert got is not None and got.nodes == ("a", "a", "b", "b") and got.warnings == ()
    assert [["a", "b", "a", "b"][i] for i in order] == ["a", "a", "b", "b"]
    assert "shard groups of 2 on one node each" in got.reason
    # with tp inside: a shard group of 2 TP groups of 2 is 4 consecutive ranks on one node
    big = place([("a", 4), ("b", 4)], MeshDims(dp_replicate=2, dp_shard=2, tp=2, plan="hsdp"))
    assert big.nodes == tuple("aaaabbbb") and big.warnings == ()
    # nodes of 3 cannot hold shard groups of 2 whole: the one that spans is named, with the rule
    odd = place([("a", 3), ("b", 3)], MeshDims(dp_replicate=3, dp_shard=2, plan="hsdp"))
    assert len(odd.warnings) == 1 and "shard group of ranks" in odd.warnings[0]
    assert "parallel.shard_size=2" in odd.warnings[0]
    # fsdp alone (one shard group of the whole world) keeps its order: nothing to place
    assert arrange(["a", "b", "a", "b"], MeshDims(dp_shard=4, plan="fsdp")) == ([0, 1, 2, 3], None)
