"""Pipeline schedules in the cost model: the bubble and the activations a rank holds in flight. Closed forms,
each checked against :mod:`elastictrain.parallel.bubble`'s timelines of torch's own action lists
(tests/test_planner.py); where no closed form holds (the zero-bubble schedules with few micro-batches) the
timeline itself answers (it imports torch, lazily, for those cases only)."""

from __future__ import annotations

import functools

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
LOOPED = ("interleaved_1f1b", "zero_bubble", "zbv")


def bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """The idle share of a step: ``(p-1)/(m+p-1)`` for gpipe and 1f1b, ``(p-1)/(v m+p-1)`` for interleaved
    1F1B with ``m >= p`` (``1 - v m/(v p+m-1)`` below: one round cannot start its loop early), and
    ``(p-1)/(3 v m+p-1)`` for the zero-bubble schedules once they have enough micro-batches (``m >= p``;
    zbv ``m >= 2p``): their weight-gradient halves fill what 1F1B leaves idle (arXiv:2401.10241)."""
    if pp <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (v * m + pp - 1) if m >= pp else 1 - v * m / (v * pp + m - 1)
    if schedule == "zero_bubble" and m >= pp or schedule == "zbv" and m >= 2 * pp:
        return (pp - 1) / (3 * v * m + pp - 1)
    return _timeline_bubble(schedule, pp, m, v)


@functools.lru_cache(maxsize=1024)
def _timeline_bubble(schedule: str, pp: int, m: int, v: int) -> float:
    from elastictrain.parallel.bubble import schedule_bubble

    return schedule_bubble(schedule, pp, m, v)


def in_flight(schedule: str, pp: int, m: int, v: int = 1) -> int:
    """The most micro-batches' activations one rank holds at once, in virtual-stage units (each is the
    activations of ``layers / (pp * v)`` blocks for one micro-batch): gpipe runs every forward first (``m``),
    1f1b warms up with at most ``p`` (``min(m, p)``), interleaved 1F1B ``min(v m, v p + p - 1)``, the
    zero-bubble schedules ``min(v m, v p)`` (rank 0, the worst)."""
    if pp <= 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp)
    if schedule == "interleaved_1f1b":
        return min(v * m, v * pp + pp - 1)
    return min(v * m, v * pp)
