"""The one exception type of the checkpoint package."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, committed, found or trusted.

    The message names the URI involved, what went wrong and, where there is one, the fix.
    """


def root_causes(exc: BaseException) -> list[tuple[int | None, BaseException]]:
    """The underlying exceptions of a DCP failure: DCP's ``CheckpointException`` (a ``BaseException``)
    carries one per failed rank; anything else is its own cause."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return [(rank, pair[0] if isinstance(pair, tuple) else pair) for rank, pair in sorted(failures.items())]
    return [(None, exc)]
