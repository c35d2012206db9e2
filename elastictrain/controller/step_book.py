"""What the ledger counted for each step number, so a step counts once however often it ran.

A recovery that restores an older step than the last one reported makes the steps after it run again (a
redo). Their first attempt was reported and counted (goodput seconds, throughput figures); the redo
replaces it: :meth:`StepBook.put` returns what the first attempt counted, for the ledger to take back
(its step time becomes goodput's ``redone_s``: work lost to the restore) and the run's medians keep the
newest attempt only. Columns are flat arrays indexed by step (8 bytes per figure per step: less than the
ledger's lists of step times already hold), NaN where nothing was counted."""

from __future__ import annotations

import math
import statistics
from array import array

COLUMNS = ("productive_s", "degraded_s", "compile_s", "tokens_per_s_per_device", "mfu")
_NONE = float("nan")


class StepBook:
    def __init__(self) -> None:
        self._cols = {name: array("d") for name in COLUMNS}

    def reported(self, step: int) -> bool:
        """Whether ``step`` was counted before (a step event was written for it)."""
        col = self._cols["productive_s"]
        return 0 <= step < len(col) and not math.isnan(col[step])

    def put(self, step: int, **values: float | None) -> dict[str, float] | None:
        """Count ``step``'s figures (``COLUMNS``; a figure left out or None: none). Returns what an earlier
        attempt of the same step counted (NaN-free: figures it had), or None when it is the step's first.
        Raises ValueError for a name not in ``COLUMNS`` or a step below 1."""
        if step < 1:
            raise ValueError(f"step numbers start at 1, got {step}")
        unknown = set(values) - set(COLUMNS)
        if unknown:
            raise ValueError(f"unknown step book column(s) {sorted(unknown)}; known: {COLUMNS}")
        before = None
        if self.reported(step):
            before = {n: c[step] for n, c in self._cols.items() if not math.isnan(c[step])}
        for name, col in self._cols.items():
            if len(col) <= step:
                col.extend([_NONE] * (step + 1 - len(col)))
            value = values.get(name)
            col[step] = _NONE if value is None else float(value)
        if math.isnan(self._cols["productive_s"][step]):  # the mark of a reported step
            self._cols["productive_s"][step] = 0.0
        return before

    def median(self, name: str) -> float | None:
        """The median of ``name`` over the steps that have it (each step's newest attempt), or None."""
        values = [v for v in self._cols[name] if not math.isnan(v)]
        return statistics.median(values) if values else None
