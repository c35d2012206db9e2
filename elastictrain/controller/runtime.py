"""The seam between the controller and what runs its workers: how a call's result is waited for and
taken, which nodes are alive, where drain notices come from.

The controller calls its workers as ``slot.actor.<method>.remote(...)`` and gets back a reference; it waits
for and takes references only through a :class:`Runtime`. :class:`RayRuntime` is Ray itself (the default of
:class:`~elastictrain.controller.group.WorkerGroup`); the simulator (:mod:`elastictrain.sim`) implements
the same protocol over fake workers in one process, so the real controller runs unchanged at 10,000 ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
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


RAY = RayRuntime()
