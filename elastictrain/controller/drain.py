"""Ray drain notices: which nodes the cluster is about to take away (spot preemption, scale-down).

Ray exposes a node's drain state through the GCS node table (``state_snapshot.state == DRAINING``), the
same state the autoscaler and ``ray drain-node`` set. That API is not covered by Ray's stability promises,
so a failure to read it turns the watcher off (said once) instead of failing the run.
"""

from __future__ import annotations

import time
from typing import Any

_DRAINING = 3  # ray.rpc.NodeSnapshot.DRAINING


class DrainWatcher:
    """Polls the GCS node table at most every ``interval_s`` seconds."""

    def __init__(self, gcs_address: str, interval_s: float = 1.0) -> None:
        self._address = gcs_address
        self._interval = interval_s
        self._client: Any = None
        self._next = 0.0
        self.disabled_reason: str | None = None
        self._told = False

    def take_notice(self) -> str | None:
        """Once, after the watcher turned itself off: why (for an event and a log line); else None."""
        if self.disabled_reason is None or self._told:
            return None
        self._told = True
        return self.disabled_reason

    def draining(self, now: float | None = None) -> set[str]:
        """Hex ids of nodes that are draining (empty between polls or when disabled)."""
        now = time.monotonic() if now is None else now
        if self.disabled_reason or now < self._next:
            return set()
        self._next = now + self._interval
        try:
            if self._client is None:
                import ray

                self._client = ray._raylet.GcsClient(address=self._address)
            infos = self._client.get_all_node_info(timeout=5)
            return {nid.hex() for nid, info in infos.items() if info.state_snapshot.state == _DRAINING}
        except Exception as e:  # noqa: BLE001 - an unstable Ray API must not stop training
            self.disabled_reason = (f"drain notices unavailable ({type(e).__name__}: {e}); nodes drained by Ray "
                                    "are now seen only when they go away")
            return set()
