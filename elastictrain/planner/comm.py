"""Collective costs on the link they cross. Pure.

Rank order is row-major over ``(pp, dp_replicate, dp_shard, tp)`` (tp innermost), and a node holds
``devices_per_node`` consecutive ranks. A group of ``size`` ranks spaced ``stride`` apart lies inside one node
when ``stride * size <= devices_per_node`` (it then moves over the intra-node link); otherwise its ring
crosses nodes and the slowest link, the inter-node one, sets its pace.

Ring algorithms (bandwidth terms, Patarasuk & Yuan 2009; NCCL's "bus bandwidth"): an all-reduce of ``B``
bytes over ``N`` ranks moves ``2 (N-1)/N B`` per rank, an all-gather or a reduce-scatter ``(N-1)/N B``; each
also pays ``2 (N-1)`` or ``N-1`` latencies. A point-to-point send moves ``B`` once.
"""

from __future__ import annotations

from elastictrain.planner.inputs import Candidate, Cluster


def crosses_nodes(stride: int, size: int, devices_per_node: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart spans more than one node."""
    return size > 1 and stride * size > devices_per_node


def link_bw(cluster: Cluster, stride: int, size: int) -> float:
    """Bytes/s per device of the slowest link a group's ring crosses."""
    inter = cluster.nodes > 1 and crosses_nodes(stride, size, cluster.devices_per_node)
    return cluster.inter_node_bw if inter else cluster.intra_node_bw


def all_reduce_s(nbytes: float, n: int, bw: float, latency_s: float = 0.0) -> float:
    """Ring all-reduce: ``2 (n-1)/n`` of the bytes at ``bw`` bytes/s, plus ``2 (n-1)`` latencies."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency_s


def all_gather_s(nbytes: float, n: int, bw: float, latency_s: float = 0.0) -> float:
    """Ring all-gather (or reduce-scatter) of ``nbytes`` in all: ``(n-1)/n`` of them, ``n-1`` latencies."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * latency_s


def p2p_s(nbytes: float, bw: float, latency_s: float = 0.0) -> float:
    return nbytes / bw + latency_s


def group_links(cluster: Cluster, c: Candidate) -> dict[str, float]:
    """The bandwidth of each axis's group: its ranks are ``MeshDims.stride(axis)`` apart (``tp`` 1,
    ``cp`` tp, ``dp_shard`` cp x tp, ``dp_replicate`` dp_shard x cp x tp, ``pp`` dp x cp x tp)."""
    return {n: link_bw(cluster, c.dims.stride(n), c.dims.size(n)) for n in c.dims.axes}
