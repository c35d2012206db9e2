"""The seam between the controller and what runs its workers: how a call's result is waited for and
taken, which nodes are alive, where drain notices come from, how the peer tier's keepers are started.

The controller calls its workers as ``slot.actor.<method>.remote(...)`` and gets back a reference; it waits
for and takes references only through a :class:`Runtime`. :class:`RayRuntime` is Ray itself (the default of
:class:`~elastictrain.controller.group.WorkerGroup`); the simulator (:mod:`elastictrain.sim`) implements
the same protocol over fake workers in one process, so the real controller runs unchanged at 10,000 ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Any, Protocol

import ray


class Runtime(Protocol):
    """What the controller needs from whatever runs its workers."""

    def wait(self, refs: Sequence[Any], *, num_returns: int = 1,
             timeout: float | None = None) -> tuple[list[Any], list[Any]]:
        """Like ``ray.wait``: (ready, not ready), waiting up to ``timeout`` s for ``num_returns`` ready."""

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        """Like ``ray.get``: the value (or values, for a list); raises the call's error, or
        ``ray.exceptions.GetTimeoutError`` after ``timeout`` s."""

    def alive_nodes(self) -> set[str]:
        """Ids of the nodes alive now."""

    def drain_watcher(self) -> Any:
        """An object with ``draining() -> set[str]`` (node ids about to go) and ``take_notice()``."""

    def watch(self, refs: Sequence[Any]) -> RunWatch:
        """Watch a generation's in-flight ``run`` calls: how a death (the call fails) or the end of the
        loop is learned without looking at each call every poll interval."""

    def start_keeper(self, node: str, budget: int) -> Any:
        """A peer-tier keeper (``ShardKeeper``'s calls: ``set_budget``, ``catalog``...) bound to ``node``
        (it dies with its node), keeping up to ``budget`` bytes."""

    def stop_keeper(self, keeper: Any) -> None:
        """End a keeper this run started (:meth:`start_keeper`); raises if it is gone already."""

    def free_memory(self, nodes: set[str]) -> list[int]:
        """The memory each alive node among ``nodes`` offers (bytes; nodes that do not say are left out)."""


class RunWatch(Protocol):
    def wait(self, timeout: float) -> list[Any]:
        """The watched calls that ended since the last call (each once), waiting up to ``timeout`` s for
        the first."""


GET_CHUNK = 1024  # refs per ``get`` in :func:`get_each`


def get_each(rt: Runtime, refs: Sequence[Any]) -> list[tuple[Any, Exception | None]]:
    """Each ready ref's result or error, in order: ``(value, None)`` or ``(None, error)``.

    One ``get`` per chunk of :data:`GET_CHUNK` refs, not one per ref (Ray pays a round trip per ``ray.get``;
    a generation of 10,000 ranks ending was 10,000 of them). A ``get`` of many raises on the first failed
    call among them (a dead actor's), so a chunk that raises is split in halves until each failed call is
    on its own: failures that come together (a lost node's ranks) cost a few more ``get`` calls, not one
    per ref. ``refs`` must be ready (``wait`` said so): nothing here waits."""
    refs = list(refs)
    out: list[tuple[Any, Exception | None]] = []

    def take(part: list[Any]) -> None:
        try:
            out.extend(zip(rt.get(part), repeat(None)))
        except Exception as e:  # noqa: BLE001 - the caller decides what a failed call means
            if len(part) == 1:
                out.append((None, e))
                return
            mid = len(part) // 2
            take(part[:mid])
            take(part[mid:])

    for i in range(0, len(refs), GET_CHUNK):
        take(refs[i:i + GET_CHUNK])
    return out


class RayRuntime:
    """:class:`Runtime` over Ray (the driver must have called ``ray.init``)."""

    def wait(self, refs: Sequence[Any], *, num_returns: int = 1,
             timeout: float | None = None) -> tuple[list[Any], list[Any]]:
        return ray.wait(list(refs), num_returns=num_returns, timeout=timeout)

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        return ray.get(refs, timeout=timeout)

    def alive_nodes(self) -> set[str]:
        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    def drain_watcher(self) -> Any:
        from elastictrain.controller.drain import DrainWatcher

        return DrainWatcher(ray.get_runtime_context().gcs_address)

    def watch(self, refs: Sequence[Any]) -> RayRunWatch:
        return RayRunWatch(refs)

    def start_keeper(self, node: str, budget: int) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from elastictrain.checkpoint import ShardKeeper

        return ShardKeeper.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(budget)

    def stop_keeper(self, keeper: Any) -> None:
        ray.kill(keeper, no_restart=True)

    def free_memory(self, nodes: set[str]) -> list[int]:
        return [int(n["Resources"]["memory"]) for n in ray.nodes()
                if n.get("Alive") and n["NodeID"] in nodes and n["Resources"].get("memory")]


class RayRunWatch:
    """One ``ray.wait`` for the first ended call and one to take the others that ended with it: Ray's
    own notifications (an actor's death fails its calls), two calls per poll interval whatever N."""

    def __init__(self, refs: Sequence[Any]) -> None:
        self.pending = list(refs)

    def wait(self, timeout: float) -> list[Any]:
        if not self.pending:
            return []
        ready, self.pending = ray.wait(self.pending, num_returns=1, timeout=timeout)
        if ready and self.pending:
            more, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
            ready += more
        return ready


RAY = RayRuntime()
