"""Telling a rank's own error from a peer's death, for a step that raised: by the exception's type and
origin, never by its words (a user's ``RuntimeError("socket timeout")`` is the user's error).

A collective that fails because a peer died or stopped answering raises one of two ways:

* a ``torch.distributed.DistError`` (``DistBackendError``, ``DistNetworkError``, ``DistStoreError``): typed
  by c10d, NCCL's errors among them;
* gloo raises a plain ``RuntimeError`` from its C++ transport. Its origin tells it apart: either the
  innermost Python frame that raised it (past torch's op and autograd plumbing) is torch.distributed's own
  code (a collective torch.distributed called: FSDP's all-gathers, DTensor's, ``dist.all_reduce``...), or it
  came out of C++ at a collective the framework called itself (DDP's all-reduce inside the last
  ``backward``, the (loss, stop) word's wait), inside :func:`framework_collective`, with the backend's
  source location that gloo and c10d put in their messages (``[.../gloo/transport/tcp/pair.cc:537]``).

Anything else is this rank's own error, whatever its text and wherever it was raised (the user's loss, the
user's model forward, a custom autograd function, the pipeline's loss the schedule calls): a failure of this
rank, counted and quoted.
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from collections.abc import Iterator

import torch.distributed as dist

# paths are matched by their parts, not this install's prefix: a remote traceback names a worker's files
_TORCH_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"
_FRAMEWORK = f"{os.sep}elastictrain{os.sep}"
# torch's dispatch and autograd frames between a caller and the C++ that raised: not an origin
_PLUMBING = tuple(f"{os.sep}torch{os.sep}{p}" for p in ("_ops.py", "_tensor.py", f"autograd{os.sep}",
                                                         f"utils{os.sep}", "_compile.py", f"_dynamo{os.sep}"))
# where gloo and c10d say an error was raised: "[<path>/gloo/transport/tcp/pair.cc:537] ..."
# (DDP's reducer wraps it: "Got the following error when running the callback: RuntimeError: [...]")
_BACKEND_SOURCE = re.compile(r"\[[^\]\s]*/(gloo|c10d|nccl)/[^\]\s]*\.(cc|cpp|h|hpp):\d+\]", re.IGNORECASE)
_IN_COLLECTIVE = "_elastictrain_in_collective"


@contextlib.contextmanager
def framework_collective() -> Iterator[None]:
    """Around a collective the framework itself calls (not code of the user's): an exception leaving it
    is marked as raised inside one, so :func:`is_communication_error` can judge a plain ``RuntimeError``
    coming out of the backend's C++ there by its origin."""
    try:
        yield
    except BaseException as e:
        try:
            setattr(e, _IN_COLLECTIVE, True)
        except AttributeError:  # an exception type without a __dict__: judged by type and origin alone
            pass
        raise


def _origin(frames: list[str]) -> str | None:
    """The innermost file of ``frames`` (outermost first) that is not torch's plumbing; None if none."""
    for filename in reversed(frames):
        if not any(p in filename for p in _PLUMBING):
            return filename
    return None


def _frames(exc: BaseException, remote_traceback: str | None) -> list[str]:
    if exc.__traceback__ is not None:
        return [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    if remote_traceback:  # an exception that crossed processes (Ray) keeps its traceback as text only
        return re.findall(r'File "([^"]+)", line \d+', remote_traceback)
    return []


def _is_backend_failure(e: BaseException, remote_traceback: str | None) -> bool:
    if isinstance(e, dist.DistError):
        return True
    if not isinstance(e, (RuntimeError, OSError)):
        return False
    origin = _origin(_frames(e, remote_traceback))
    if origin is not None and _TORCH_DISTRIBUTED in origin:
        return True  # raised by torch.distributed's own code: one of its collectives failed
    from_cpp_at_our_call = origin is None or _FRAMEWORK in origin
    return bool(getattr(e, _IN_COLLECTIVE, False)) and from_cpp_at_our_call and bool(_BACKEND_SOURCE.search(str(e)))


def is_communication_error(exc: BaseException, remote_traceback: str | None = None) -> bool:
    """True if ``exc`` (or an exception it was raised from) comes from the communication backend, judged
    by type and origin (module doc). ``remote_traceback``: the formatted traceback of an exception that
    crossed processes (Ray's ``RayTaskError.traceback_str``), whose own frames are gone."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        if _is_backend_failure(e, remote_traceback if e is exc else None):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def classify_step_error(exc: BaseException) -> str:
    """``peer_failed`` when a collective failed under this rank (a peer's death: the controller finds the
    dead one), else ``error`` (this rank's own failure), whatever phase the rank was in."""
    return "peer_failed" if is_communication_error(exc) else "error"
