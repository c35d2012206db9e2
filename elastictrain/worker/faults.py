"""Fault injection addressed by (rank, step, point): kill, hang, raise, slow, nan, abort, stall, hold. Off
unless configured.

``nan`` makes that rank's loss and gradients non-finite at that step (any point). ``abort`` does at its
point what the controller's ``abort_group`` does: marks this generation's group aborted (point ``commit``:
between the step's word and the optimizer, where an NCCL abort lands while the rank waits for the device).
``stall`` waits at its point, in phase "collective", until the group is aborted (a collective that never
completes: what an NCCL rank does in a device sync whose peer hangs), then fails as an aborted collective.

``hold`` keeps a generation where it is until the controller ends it, instead of slowing it for a while:
at the first step from ``step`` on that the rank reaches at its point (``before_step``, ``mid_step`` or
``after_step``) in its generation, the rank waits until the controller asks the generation to stop at a
step boundary (``Worker.request_stop``: a grow-back, a re-plan, a preemption; the flag the step's word
carries) or aborts its group (a failure), at most ``seconds``; then it goes on as if nothing happened. A
stop ends the hold at once and is the step's own: held at ``before_step`` or ``mid_step``, that step is
the generation's last; at ``after_step``, the next one is. It waits in phase "compute" (a slow step to the
watchdog: never a hang, never a stall to abort), so it is meant for every rank of the generation: a rank
left out runs into the step and waits in its collectives, where the watchdog takes the held ones for hung.
A test that folds a run and must see it grow back holds the folded generation (e.g. every rank of
generation 1 at ``before_step`` of step 1, with ``seconds`` the replacement's start-up bound): it trains one
step there, exactly when the replacement is ready, and no clock decides whether the grow-back comes.
Like ``slow`` it changes no number and leaves the process poolable (``touched`` stays false)."""

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
        # workers.reuse it is never pooled (Worker.retire, controller/warm_pool.py). ``slow``, ``hold`` and
        # ``nan`` change a step's time or numbers, not the process: they do not count
        self.touched = False
        # set by the step runner (``bind``): what ``abort``, ``stall`` and ``hold`` do to this worker's group
        self._abort: Callable[[], None] | None = None
        self._stall: Callable[[], None] | None = None
        self._hold: Callable[[float], bool] | None = None

    def bind(self, abort: Callable[[], None], stall: Callable[[], None],
             hold: Callable[[float], bool] | None = None) -> None:
        """``abort()`` marks the current generation's group aborted; ``stall()`` blocks until it is;
        ``hold(seconds)`` blocks until the controller asks the generation to stop or aborts it (at most
        ``seconds``) and returns whether the stop was asked."""
        self._abort, self._stall, self._hold = abort, stall, hold

    def fire(self, *, rank: int, step: int, point: str, generation: int) -> bool:
        """Act on the faults addressed here. Returns True when a ``hold`` here ended because the controller
        asked this generation to stop: the caller puts that stop into the step's word (see the module)."""
        stop = False
        for i, f in enumerate(self._faults):
            if f.point == "backward" or f.kind == "nan":  # armed on the loss instead: see arm_backward, nan_at
                continue
            # a hold takes the first step from ``step`` on (where a fold resumes is not always known)
            reached = step >= f.step if f.kind == "hold" else step == f.step
            if f.rank != rank or not reached or f.point != point:
                continue
            if f.generation is not None and f.generation != generation:
                continue
            if i in self._fired and not f.repeat:
                continue
            self._fired.add(i)
            # slow acts through extra_delay, hold only waits: neither changes the process
            self.touched = self.touched or f.kind not in ("slow", "hold")
            stop = self._act(f) or stop
        return stop

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

    def _act(self, f: FaultConfig) -> bool:
        if f.kind == "hold":
            return self._hold is not None and self._hold(f.seconds)
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
        return False
