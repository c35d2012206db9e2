"""PURE: which checkpoint steps to delete."""

from __future__ import annotations

from collections.abc import Iterable


def retention_victims(
    committed: Iterable[int],
    uncommitted: Iterable[int],
    keep_last: int,
    keep_every: int,
    in_use: frozenset[int] = frozenset(),
) -> list[int]:
    """Steps to delete, ascending.

    Keeps: the newest committed step (always), the ``keep_last`` newest committed, every committed step
    that is a multiple of ``keep_every`` (if > 0), and anything in ``in_use``. Uncommitted step dirs older
    than the newest committed are abandoned saves and go; newer ones may still be in flight and stay.
    Raises ValueError for ``keep_last < 1`` or ``keep_every < 0``.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is always kept), got {keep_last}")
    if keep_every < 0:
        raise ValueError(f"keep_every must be >= 0 (0 disables), got {keep_every}")
    done = sorted(set(committed))
    if not done:
        return []
    newest = done[-1]
    keep = set(done[-keep_last:]) | {newest} | set(in_use)
    if keep_every:
        keep |= {s for s in done if s % keep_every == 0}
    delete = {s for s in done if s not in keep}
    delete |= {s for s in set(uncommitted) if s < newest and s not in in_use and s not in set(done)}
    return sorted(delete)
