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

    def start_keeper(self, node: str, budget: int, *, reuse: bool = False, timeout: float | None = None,
                     lease: str | None = None) -> Any:
        """A peer-tier keeper (``ShardKeeper``'s calls: ``set_budget``, ``catalog``...) bound to ``node``
        (it dies with its node), keeping up to ``budget`` bytes of puts sent under ``lease`` (the run's).
        ``reuse``: an idle keeper of this driver on ``node`` is taken if it answers ``reset`` empty within
        ``timeout`` (controller/keeper_pool.py)."""

    def stop_keeper(self, keeper: Any, *, node: str | None = None, reuse: bool = False,
                    timeout: float | None = None) -> None:
        """End a keeper this run started or took (:meth:`start_keeper`); raises if it is gone already.
        ``reuse``: give it, reset and checked empty within ``timeout``, to the driver's pool as ``node``'s."""

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

    def start_keeper(self, node: str, budget: int, *, reuse: bool = False, timeout: float | None = None,
                     lease: str | None = None) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from elastictrain.checkpoint import ShardKeeper
        from elastictrain.controller.keeper_pool import KEEPERS, kill_keeper
        from elastictrain.controller.warm_pool import current_session

        while reuse and (keeper := KEEPERS.take(current_session(), node)) is not None:
            if _empty_after_reset(keeper, budget, timeout, lease):
                KEEPERS.reused += 1
                return keeper
            kill_keeper(keeper)
        KEEPERS.started += 1
        return ShardKeeper.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(budget, lease)

    def stop_keeper(self, keeper: Any, *, node: str | None = None, reuse: bool = False,
                    timeout: float | None = None) -> None:
        from elastictrain.controller.keeper_pool import IDLE_BUDGET, IDLE_LEASE, KEEPERS
        from elastictrain.controller.warm_pool import current_session

        if reuse and node is not None and _empty_after_reset(keeper, IDLE_BUDGET, timeout, IDLE_LEASE):
            KEEPERS.give(current_session(), node, keeper)
            return
        ray.kill(keeper, no_restart=True)

    def free_memory(self, nodes: set[str]) -> list[int]:
        return [int(n["Resources"]["memory"]) for n in ray.nodes()
                if n.get("Alive") and n["NodeID"] in nodes and n["Resources"].get("memory")]


def _empty_after_reset(keeper: Any, budget: int, timeout: float | None, lease: str | None) -> bool:
    """True if ``keeper`` answered ``reset(budget, lease)`` within ``timeout`` holding nothing."""
    try:
        stats = ray.get(keeper.reset.remote(budget, lease), timeout=timeout)
    except Exception:  # noqa: BLE001 - dead or hung: not reusable
        return False
    return stats.get("bytes") == 0 and stats.get("entries") == 0


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
