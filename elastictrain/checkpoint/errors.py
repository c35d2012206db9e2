"""The one exception type of the checkpoint package."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, committed, found or trusted.

    The message names the URI involved, what went wrong and, where there is one, the fix.
    """
