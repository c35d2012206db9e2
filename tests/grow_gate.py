"""The gate a fold-and-grow test holds its folded generation at: the ``hold`` fault (worker/faults.py) on
every rank of that generation before its first step. The folded generation waits there until the
replacement is ready and the controller stops it to grow back, trains that one step (at the folded size)
and grows: no slowed steps that must outlast a cold replacement's start-up (a clock that a loaded machine
beats with nothing broken, and that a quiet one sleeps through), and no steps run only to leave room."""

from __future__ import annotations

# The longest the folded generation waits for its replacement: these tests' timeouts.restart_grace_s, past
# which the controller gives a replacement up anyway (then the run goes on folded and the test fails on its
# sizes: something is broken). Never reached when the grow-back comes.
GROW_WAIT_S = 240.0


def hold_until_grown(world: int, generation: int = 1, seconds: float = GROW_WAIT_S) -> list[dict]:
    """``hold`` faults for ranks 0..world-1 of ``generation`` (the folded one, of ``world`` ranks), before
    the first step it reaches (from step 1 on: wherever its recovery source put it)."""
    return [{"rank": r, "step": 1, "point": "before_step", "kind": "hold", "seconds": seconds,
             "generation": generation} for r in range(world)]
