"""Telling a rank's own error from a peer's death, for a step that raised (pure: unit-testable).

A collective that fails because a peer died or stopped answering raises from the communication backend
(gloo/NCCL: "Connection closed by peer", a timeout...), as a plain ``RuntimeError`` or a
``torch.distributed.DistError``. Anything else, raised while this rank was in its last backward (the
"collective" phase) or anywhere else, is this rank's own error: a failure of this rank, counted and quoted.
"""

from __future__ import annotations

import torch.distributed as dist

# Substrings of the messages gloo, NCCL and c10d raise when the other side of a collective is gone.
_COMM_MARKERS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
    "gloo/transport", "timed out", "timeout", "nccl", "processgroup", "socket", "no route to host",
    "was aborted", "abort", "unreachable",
)


def is_communication_error(exc: BaseException) -> bool:
    """True if ``exc`` (or an exception it was raised from) comes from the communication backend."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        if isinstance(e, (dist.DistError,)) or isinstance(e, (ConnectionError, TimeoutError)):
            return True
        text = str(e).lower()
        if isinstance(e, RuntimeError) and any(m in text for m in _COMM_MARKERS):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def classify_step_error(exc: BaseException) -> str:
    """``peer_failed`` when a collective failed under this rank (a peer's death: the controller finds the
    dead one), else ``error`` (this rank's own failure), whatever phase the rank was in."""
    return "peer_failed" if is_communication_error(exc) else "error"
