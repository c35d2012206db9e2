"""Fault injection addressed by (rank, step, point): kill, hang, raise, slow, nan, abort, stall. Off unless
configured.

``nan`` makes that rank's loss and gradients non-finite at that step (any point). ``abort`` does at its
point what the controller's ``abort_group`` does: marks this generation's group aborted (point ``commit``:
between the step's word and the optimizer, where an NCCL abort lands while the rank waits for the device).
``stall`` waits at its point, in phase "collective", until the group is aborted (a collective that never
completes: what an NCCL rank does in a device sync whose peer hangs), then fails as an aborted collective."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from elastictrain.config import FaultConfig


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault: the worker reports it as its own failure."""


class FaultInjector:
    """Fires the configured faults of one worker. ``step`` is 1-based, as in ``step`` events."""

    def __init__(self, faults: Sequence[FaultConfig]) -> None:
        self._faults = list(faults)
        self._fired: set[int] = set()
        # a fault fired in this process (kill, hang, raise, abort, stall; a raise armed on a backward): under
        # workers.reuse it is never pooled (Worker.retire, controller/warm_pool.py). ``slow`` and ``nan``
        # change a step's time or numbers, not the process: they do not count
        self.touched = False
        # set by the step runner (``bind``): what ``abort`` and ``stall`` do to this worker's group
        self._abort: Callable[[], None] | None = None
        self._stall: Callable[[], None] | None = None

    def bind(self, abort: Callable[[], None], stall: Callable[[], None]) -> None:
        """``abort()`` marks the current generation's group aborted; ``stall()`` blocks until it is."""
        self._abort, self._stall = abort, stall

    def fire(self, *, rank: int, step: int, point: str, generation: int) -> None:
        for i, f in enumerate(self._faults):
            if f.point == "backward" or f.kind == "nan":  # armed on the loss instead: see arm_backward, nan_at
                continue
            if f.rank != rank or f.step != step or f.point != point:
                continue
            if f.generation is not None and f.generation != generation:
                continue
            if i in self._fired and not f.repeat:
                continue
            self._fired.add(i)
            self.touched = self.touched or f.kind != "slow"  # a slow fault acts through extra_delay only
            self._act(f)

    def arm_backward(self, loss: Any, *, rank: int, step: int, generation: int) -> None:
        """Point ``backward``: a ``raise`` fault is raised by autograd inside the last backward of the step
        (while the peers wait in its collectives), as a ``ValueError`` like a user's own code would raise:
        not an :class:`InjectedFault`, so the worker must tell it from a peer's death on its own."""
        for i, f in enumerate(self._faults):
            if (f.kind != "raise" or f.point != "backward" or f.rank != rank or f.step != step
                    or (f.generation is not None and f.generation != generation)
                    or (i in self._fired and not f.repeat)):
                continue
            self._fired.add(i)
            self.touched = True
            message = f"injected fault at rank {f.rank} step {f.step} (backward): this rank's own error"

            def hook(grad: Any) -> Any:
                raise ValueError(message)

            loss.register_hook(hook)

    def extra_delay(self, *, rank: int, step: int, generation: int) -> float:
        """Seconds a ``slow`` fault adds to this step (it slows every step from ``step`` on)."""
        return sum(
            f.seconds for f in self._faults
            if f.kind == "slow" and f.rank == rank and step >= f.step
            and (f.generation is None or f.generation == generation)
        )

    def nan_at(self, *, rank: int, step: int, generation: int) -> bool:
        """True if a ``nan`` fault makes this rank's loss and gradients non-finite at ``step``."""
        return any(f.kind == "nan" and f.rank == rank and f.step == step
                   and (f.generation is None or f.generation == generation) for f in self._faults)

    def _act(self, f: FaultConfig) -> None:
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "hang":
            # A real hang: stop the whole process, so it answers nothing (not even Ray's RPCs).
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "raise":
            raise InjectedFault(f"injected fault at rank {f.rank} step {f.step} ({f.point})")
        elif f.kind == "abort" and self._abort is not None:
            self._abort()
        elif f.kind == "stall" and self._stall is not None:
            self._stall()
        # "slow" is applied through extra_delay()
