"""Worker-side log lines: one line each, prefixed with the worker's current rank, never a traceback wall for
a fault the framework expects and handles (a peer died, a collective was aborted, an injected fault).

:func:`configure_worker_logging` is called once in each worker process; :func:`set_worker_rank` whenever the
worker joins a membership generation, so the prefix follows the rank (ranks are renumbered on a resize).
Ray adds its own ``(Worker pid=...)`` prefix when it forwards the line to the driver's console.
"""

from __future__ import annotations

import logging
import sys
import traceback

_state = {"rank": "-", "world": "-", "slot": "-", "generation": "-"}
_CONFIGURED = False

# Exceptions the framework handles itself (recovery, regroup): log their one-line summary, not the stack.
EXPECTED = ("DistBackendError", "InjectedFault", "ActorDiedError", "RayActorError", "TimeoutError",
            "ConnectionResetError", "BrokenPipeError")


class _RankPrefix(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.et_prefix = (f"[rank {_state['rank']}/{_state['world']} slot {_state['slot']} "
                            f"gen {_state['generation']}]")
        if record.exc_info and record.exc_info[0] is not None and record.exc_info[0].__name__ in EXPECTED:
            record.msg = f"{record.getMessage()}: {one_line(record.exc_info[1])}"
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


def one_line(exc: BaseException | None) -> str:
    """``Type: first line of the message`` (the last frame's location appended), for an expected fault."""
    if exc is None:
        return "no exception"
    text = str(exc).strip().splitlines()
    where = ""
    tb = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if tb:
        where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})"
    return f"{type(exc).__name__}: {text[0] if text else ''}{where}"


def configure_worker_logging(slot: int, level: int = logging.INFO) -> logging.Logger:
    """Install the rank-prefixed one-line handler on the ``elastictrain.worker`` logger (idempotent)."""
    global _CONFIGURED
    _state["slot"] = str(slot)
    logger = logging.getLogger("elastictrain.worker")
    if not _CONFIGURED:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(et_prefix)s %(levelname)s %(name)s: %(message)s"))
        handler.addFilter(_RankPrefix())
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
        _CONFIGURED = True
    return logger


def set_worker_rank(rank: int, world_size: int, generation: int) -> None:
    _state.update(rank=str(rank), world=str(world_size), generation=str(generation))


__all__ = ["configure_worker_logging", "set_worker_rank", "one_line", "EXPECTED"]
