"""Placement by topology: which node each rank of a mesh runs on. Pure (no Ray): the controller passes
the nodes its workers are on and reorders them by rank (:func:`order_members`).

The rules, in order of priority (the material this project grew from: tensor parallel inside a node,
pipeline across nodes, data parallel outermost):

1. a tensor-parallel group (``tp`` consecutive ranks, the innermost mesh axis) never spans nodes, unless
   the nodes' slots leave no other way (then each group that spans is named in a warning: its all-reduces,
   one or two per block, cross the network); under ``hsdp`` the same holds for a shard group (its
   ``dp_shard x tp`` consecutive ranks: FSDP's all-gathers and reduce-scatters, every block, stay on the
   node and only the replicas' gradient all-reduce crosses nodes);
2. pipeline stages spread across nodes before data-parallel replicas do: each stage goes to nodes that
   hold no other stage while such nodes are left, and a stage is kept on as few nodes as fit it, so a cut
   between nodes falls between stages (point-to-point activations) before it falls between data-parallel
   replicas of one stage (their gradient reductions);
3. ties keep the order the nodes were given in (the controller gives its members' order, so a run on one
   node keeps its rank order and survivors keep their ranks where the rules allow).

Rank order is the mesh's (:class:`~elastictrain.parallel.dims.MeshDims`): rank ``r`` is in unit
``r // unit`` (:func:`unit_size`: the ranks of :func:`unit_axes`, innermost and so consecutive), and a unit's
stage is its ranks' ``pp`` coordinate (``MeshDims.coord``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elastictrain.parallel.layout import MeshDims


class PlacementError(ValueError):
    """The nodes cannot hold the mesh at all (fewer slots than ranks, or malformed nodes)."""


@dataclass(frozen=True)
class Placement:
    """``nodes[r]``: the node id of rank ``r``. ``warnings``: one line per TP group that spans nodes."""

    nodes: tuple[str, ...]
    warnings: tuple[str, ...]
    reason: str


def place(nodes: Sequence[tuple[str, int]], dims: MeshDims) -> Placement:
    """Place the ``dims.world_size`` ranks of ``dims`` on ``nodes`` (``(node id, free slots)``, in order
    of preference on ties; only as many slots as ranks are used). Raises :class:`PlacementError` when
    the slots are fewer than the ranks or a node is malformed."""
    t, p, world = unit_size(dims), dims.pp, dims.world_size
    stage_units: dict[int, list[int]] = {}  # pipeline coordinate -> its units (a unit's ranks are consecutive)
    for u in range(world // t):
        stage_units.setdefault(dims.coord(u * t)["pp"], []).append(u)
    group = _group_name(dims)
    ids = [n for n, _ in nodes]
    if len(set(ids)) != len(ids):
        raise PlacementError(f"node ids must be unique, got {ids}")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for _, s in nodes):
        raise PlacementError(f"node slots must be ints >= 0, got {[s for _, s in nodes]}")
    free = [s for _, s in nodes]
    if sum(free) < world:
        raise PlacementError(f"{world} ranks do not fit on {len(nodes)} node(s) with {sum(free)} slot(s) "
                             f"{free}: add capacity or lower workers.min/max")
    order = sorted(range(len(nodes)), key=lambda i: -free[i])  # largest first; stable: given order on ties
    unit_node: dict[int, int] = {}  # TP group -> the node holding it whole
    used: set[int] = set()          # nodes that hold an earlier stage
    for stage in range(p):
        units = iter(stage_units[stage])
        need, here = len(stage_units[stage]), set()
        while need:
            cands = [i for i in order if free[i] >= t]
            if not cands:
                break
            whole = [i for i in cands if free[i] // t >= need]
            fresh = [i for i in (whole or cands) if i not in used]
            if whole:  # the smallest node that holds the rest of the stage (best fit)
                pick = min(fresh or whole, key=lambda i: free[i])
            else:      # none does: the largest, so the stage spans as few nodes as it can
                pick = max(fresh or cands, key=lambda i: free[i])
            take = min(need, free[pick] // t)
            for _ in range(take):
                unit_node[next(units)] = pick
            free[pick] -= take * t
            need -= take
            here.add(pick)
        used |= here
    rank_node: list[int] = []
    warnings: list[str] = []
    for u in range(world // t):
        if u in unit_node:
            rank_node += [unit_node[u]] * t
            continue
        # no node has tp whole slots left: take the most free slots first, so the group spans few nodes
        got: list[int] = []
        while len(got) < t:
            pick = max(order, key=lambda i: free[i])
            n = min(t - len(got), free[pick])
            got += [pick] * n
            free[pick] -= n
        rank_node += got
        span = sorted({ids[i] for i in got}, key=ids.index)
        warnings.append(
            f"{group} of ranks {u * t}-{u * t + t - 1} spans nodes {span}: no node has {t} free slots left "
            f"for it (slots per node {[s for _, s in nodes]}); its collectives cross nodes. Give nodes a "
            f"multiple of {t} worker slots ({_unit_rule(dims)})")
    placed = tuple(ids[i] for i in rank_node)
    return Placement(placed, tuple(warnings), _describe(placed, dims, warnings))


def unit_axes(dims: MeshDims) -> tuple[str, ...]:
    """The innermost axes whose ranks must share a node: ``cp`` and ``tp`` (collectives every layer), and
    under ``hsdp`` its shard axis too (FSDP's all-gathers every block; only the replicas' all-reduce
    crosses nodes)."""
    return (("dp_shard",) if _hsdp(dims) else ()) + ("cp", "tp")


def unit_size(dims: MeshDims) -> int:
    """The consecutive ranks that must share a node: a TP (x CP) group, or under ``hsdp`` a shard group."""
    return len(dims.group_ranks(0, unit_axes(dims)))


def _hsdp(dims: MeshDims) -> bool:
    return dims.plan == "hsdp" and dims.dp_shard > 1 and dims.dp_replicate > 1


def _group_name(dims: MeshDims) -> str:
    return "shard group" if _hsdp(dims) else "CP x TP group" if dims.cp > 1 else "TP group"


def _unit_rule(dims: MeshDims) -> str:
    rule = [f"parallel.shard_size={dims.dp_shard}"] * _hsdp(dims) + [f"parallel.cp={dims.cp}"] * (dims.cp > 1)
    return " x ".join(rule + [f"parallel.tp={dims.tp}"])


def _describe(placed: tuple[str, ...], dims: MeshDims, warnings: Sequence[str]) -> str:
    nodes = sorted(set(placed), key=placed.index)
    t = unit_size(dims)
    kind = _group_name(dims) + "s"
    tp = f"{kind} of {t} on one node each" if not warnings else f"{len(warnings)} {kind[:-1]}(s) span nodes"
    out = f"{len(placed)} ranks on {len(nodes)} node(s): {tp if t > 1 else 'tp=1'}"
    if dims.pp > 1:
        inner = tuple(a for a in dims.axes if a != "pp")
        stages = [sorted({placed[r] for r in dims.group_ranks(dims.rank({"pp": s}), inner)}, key=nodes.index)
                  for s in range(dims.pp)]
        out += "; " + ", ".join(f"stage {s} on {v}" for s, v in enumerate(stages))
    return out


def order_members(member_nodes: Sequence[str], placement: Placement) -> list[int]:
    """The members (indices into ``member_nodes``, their node ids in their current rank order) by their
    new rank: rank ``r`` goes to a member on ``placement.nodes[r]`` -- member ``r`` itself when it is
    there (it keeps its rank), else the first one left on that node. Raises :class:`PlacementError` when
    the members' nodes are not the placement's."""
    if sorted(member_nodes) != sorted(placement.nodes):
        raise PlacementError(f"members on nodes {list(member_nodes)} do not match the placement "
                             f"{list(placement.nodes)}")
    left = list(range(len(member_nodes)))
    out = []
    for r, node in enumerate(placement.nodes):
        i = r if r in left and member_nodes[r] == node else next(i for i in left if member_nodes[i] == node)
        left.remove(i)
        out.append(i)
    return out


def node_slots(member_nodes: Sequence[str]) -> list[tuple[str, int]]:
    """``(node id, members on it)`` in order of first appearance: :func:`place`'s input for members that
    are already on their nodes."""
    out: dict[str, int] = {}
    for n in member_nodes:
        out[n] = out.get(n, 0) + 1
    return list(out.items())


def arrange(member_nodes: Sequence[str | None], dims: MeshDims) -> tuple[list[int], Placement | None]:
    """The controller's entry: members (their node ids, in the rank order it chose) -> their order by new
    rank, and the placement (None: the order is kept). Placed only where the mesh has a structure to
    place (``tp > 1``, ``pp > 1`` or hsdp's shard groups; a ddp/fsdp rank order is left as it is) and every
    member's node is known."""
    keep = list(range(len(member_nodes)))
    if (unit_size(dims) == 1 and dims.pp == 1) or any(n is None for n in member_nodes):
        return keep, None
    nodes = [str(n) for n in member_nodes]
    got = place(node_slots(nodes), dims)
    return order_members(nodes, got), got
