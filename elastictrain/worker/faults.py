"""Fault injection addressed by (rank, step, point): kill, hang, raise, slow. Off unless configured."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import Any

from elastictrain.config import FaultConfig


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault: the worker reports it as its own failure."""


class FaultInjector:
    """Fires the configured faults of one worker. ``step`` is 1-based, as in ``step`` events."""

    def __init__(self, faults: Sequence[FaultConfig]) -> None:
        self._faults = list(faults)
        self._fired: set[int] = set()

    def fire(self, *, rank: int, step: int, point: str, generation: int) -> None:
        for i, f in enumerate(self._faults):
            if f.point == "backward":  # armed on the loss instead: see arm_backward
                continue
            if f.rank != rank or f.step != step or f.point != point:
                continue
            if f.generation is not None and f.generation != generation:
                continue
            if i in self._fired and not f.repeat:
                continue
            self._fired.add(i)
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

    @staticmethod
    def _act(f: FaultConfig) -> None:
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "hang":
            # A real hang: stop the whole process, so it answers nothing (not even Ray's RPCs).
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "raise":
            raise InjectedFault(f"injected fault at rank {f.rank} step {f.step} ({f.point})")
        # "slow" is applied through extra_delay()
