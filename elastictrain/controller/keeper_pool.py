"""The peer memory tier's keepers kept between runs of one driver process (``workers.reuse``).

Every run with the tier on (``checkpoint.memory_every_steps`` > 0) needs one
:class:`~elastictrain.checkpoint.ShardKeeper` per node, and a keeper is a Ray actor: a fresh interpreter
that imports what Ray preloads into every worker process (torch with it), seconds of CPU per run per node.
With ``workers.reuse`` a run that ended -- any end -- gives its keepers to :data:`KEEPERS` instead of killing
them, and the next run of the same driver with the tier on takes the pooled keeper of each node.

Why the rules are what they are:

- Nothing of one run is served to another. Snapshots are keyed by (generation, rank, step), and every run
  counts generations and steps from the same numbers, so a leftover would be restored silently as the
  next run's state. A keeper is given back only after its ``reset`` (every snapshot dropped, the put
  order reset) answered, within ``timeouts.poll_s``, that it holds 0 bytes and 0 entries; the run that
  takes it resets it again to its own budget and checks the answer again. A keeper that does not answer
  so is killed. A put of the ended run still on its way (a sender thread whose flush timed out) is refused
  whenever it arrives: every put carries its run's lease (a uuid per run, ``SourceGatherer.lease``), a
  keeper serves the lease of its last reset only, and a pooled keeper's is :data:`IDLE_LEASE` (with a
  one-byte budget besides).
- Which keepers: those of nodes still alive when the run ends (a keeper on a removed node is gone with
  it), that answer ``reset`` (a keeper that died or hangs is the thing that failed: it is killed). The
  run's end does not matter: the keeper holds no state of the run once reset, unlike a worker process.
- The key: the Ray session and this driver's job (:func:`~elastictrain.controller.warm_pool.current_session`;
  the keeper's code is elastictrain's, not the task's) and the node. At most one idle keeper per node:
  a run uses one per node; a second (two runs of one driver ending in threads) is killed.
- Lifetime: the keepers are actors of this driver's job, killed with it (``ray.shutdown`` or the driver's
  exit); :meth:`KeeperPool.clear` kills them earlier. With ``workers.reuse: false`` a run starts and
  kills its own keepers and leaves the pool as it is.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import ray

IDLE_BUDGET = 1  # bytes: a pooled keeper refuses every put (a late one of the run that gave it back)
IDLE_LEASE = "idle"  # the lease of a pooled keeper: no run's (SourceGatherer.lease is a uuid)


@dataclass(frozen=True)
class PooledKeeper:
    actor: Any
    node_id: str
    session: str  # current_session() of the run that gave it back


def kill_keeper(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone (its node, its job, Ray shut down)
        pass


class KeeperPool:
    """The idle keepers of this driver, one per node at most. Thread-safe (runs in threads of one driver)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[PooledKeeper] = []
        self.started = 0  # keeper processes started by this driver (RayRuntime.start_keeper)
        self.reused = 0  # keepers taken from the pool instead

    def take(self, session: str | None, node: str) -> Any | None:
        """The idle keeper on ``node`` of ``session``, removed from the pool; None if there is none."""
        with self._lock:
            found = next((k for k in self._idle if k.session == session and k.node_id == node), None)
            if found is not None:
                self._idle.remove(found)
        return None if found is None else found.actor

    def give(self, session: str | None, node: str, actor: Any) -> None:
        """Keep ``actor`` (reset, checked empty by the caller) as ``node``'s idle keeper. Keepers of another
        session are dropped (Ray killed them with their job); a second one on ``node`` is killed."""
        with self._lock:
            self._idle = [k for k in self._idle if k.session == session]
            extra = session is None or any(k.node_id == node for k in self._idle)
            if not extra:
                self._idle.append(PooledKeeper(actor, node, session))
        if extra:
            kill_keeper(actor)

    def clear(self) -> int:
        """Kill every idle keeper; returns how many."""
        with self._lock:
            idle, self._idle = self._idle, []
        for k in idle:
            kill_keeper(k.actor)
        return len(idle)

    def nodes(self) -> list[str]:
        """The nodes with an idle keeper (for tests and reports)."""
        with self._lock:
            return sorted(k.node_id for k in self._idle)


KEEPERS = KeeperPool()
"""This driver process's idle keepers."""
