"""PURE: may a worker that finished its set-up join the run? Decided from the fingerprints it reports.

The first worker to finish its set-up fixes the run's reference fingerprint (model, optimizer, dataset:
:func:`elastictrain.checkpoint.compat.model_fingerprint` & co.). When the run resumes a checkpoint, that
first fingerprint is compared with the checkpoint's: a difference the user did not accept ends the run
with exit 3 (a checkpoint error), before any state is loaded. Every later worker (replacements included)
must report the reference fingerprint, or it is refused with the reason (at every rendezvous, not only
the first): e.g. a Parquet prefix that grew between two workers' set-ups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastictrain.checkpoint.compat import WORKER_KEYS, compare, refusal


@dataclass(frozen=True)
class Admission:
    action: str            # "admit" | "refuse" (this worker) | "checkpoint_error" (end the run, exit 3)
    reason: str = ""
    reference: dict[str, Any] | None = None  # the run's reference fingerprint after this decision


def admit(reported: dict[str, Any] | None, reference: dict[str, Any] | None, resume_meta: dict[str, Any] | None,
          accepted: tuple[str, ...] | list[str], run_id: str, where: str = "") -> Admission:
    """Decide for one worker. ``reported`` is its ``setup()`` fingerprint (``None``: it reported none and
    is admitted), ``reference`` the run's so far, ``resume_meta`` the meta of the checkpoint the run
    resumes (``None`` for a fresh start)."""
    if not reported:
        return Admission("admit", reference=reference)
    if reference is None:
        saved = (resume_meta or {}).get("fingerprint")
        if saved:
            why = refusal(compare(saved, reported, keys=WORKER_KEYS), accepted, where, run_id)
            if why:
                return Admission("checkpoint_error", why, None)
        return Admission("admit", reference=dict(reported))
    diffs = compare(reference, reported, keys=WORKER_KEYS)
    if diffs:
        return Admission("refuse", "worker built another job than the group's: " + "; ".join(
            d.line.replace("in the checkpoint", "in the group") for d in diffs), reference)
    return Admission("admit", reference=reference)
