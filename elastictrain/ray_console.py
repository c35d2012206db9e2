"""Ray's own paragraph about a dead worker, kept off the console: the ``failure`` event says it once.

When a worker process dies, Ray publishes an error to the driver ("A worker died or was killed while
executing a task by an unexpected system error ... OOM killer ...") and its error-listener thread prints
it on stdout (``ray._private.worker.listen_error_messages`` -> ``print_to_stdstream``, prefixed
``(raylet)``). For elastictrain a dead worker is an expected, handled failure, already reported by one
``failure`` event; the paragraph reads like a crash. :func:`install` routes these paragraphs to
``RUN_DIR/ray_errors.log`` of the latest run this process started (one can arrive after its run ended)
and to the ``elastictrain.ray`` logger at INFO;
every other message Ray publishes is printed as before. Ray's own session logs are untouched.

Why a Ray internal: Ray 2.60 has no public switch for these. ``ray.init(log_to_driver=False)`` stops
worker logs only; the driver's error listener (``listen_error_messages``) runs in every driver and prints
each error published for the job with ``print``, not through a logger, so ``logging_config`` and log levels
do not reach it either. The hook replaces the module attribute that thread looks up on every message, and is
guarded so a Ray upgrade cannot break a run: it installs only over a function of the shape it knows
(``print_to_stdstream(data, ignore_prefix)``), hands every call it does not recognise (or that fails to
divert) to Ray's own function unchanged, and if the attribute is gone :func:`install` does nothing (the
paragraphs show again; nothing breaks).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_log = logging.getLogger("elastictrain.ray")
_WORKER_DEATH = "A worker died or was killed while executing"
_lock = threading.Lock()
_sink: Path | None = None  # RUN_DIR/ray_errors.log of the latest run
_installed = False


def is_worker_death(data: dict[str, Any]) -> bool:
    """PURE: is this published message Ray's paragraph about a dead worker (its error listener's 'raylet'
    pseudo-process)? Worker logs, and other errors Ray publishes, are not."""
    return data.get("pid") == "raylet" and any(_WORKER_DEATH in str(line) for line in data.get("lines", ()))


def install() -> None:
    """Route worker-death paragraphs off the console for this driver process (idempotent). Does nothing
    when Ray's function is missing or not of the known shape (see the module docstring)."""
    global _installed
    with _lock:
        if _installed:
            return
        try:
            import ray._private.worker as ray_worker

            original = ray_worker.print_to_stdstream
        except (ImportError, AttributeError):
            return
        if not _known_shape(original):
            return
        ray_worker.print_to_stdstream = _diverting(original)
        _installed = True


def _known_shape(fn: Any) -> bool:
    """Is ``fn`` Ray's ``print_to_stdstream(data, ignore_prefix)`` as this hook was written against?"""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # not a Python function any more
        return False
    return callable(fn) and names == ["data", "ignore_prefix"]


def _diverting(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` that diverts worker-death paragraphs; any other call, and any failure to recognise or
    divert one, goes to ``original`` exactly as it came."""

    @functools.wraps(original)
    def print_to_stdstream(*args: Any, **kwargs: Any) -> Any:
        data = args[0] if args else kwargs.get("data")
        try:
            if isinstance(data, dict) and is_worker_death(data):
                _divert(data)
                return None
        except Exception:  # noqa: BLE001 - never let the hook break Ray's listener thread: print as Ray would
            pass
        return original(*args, **kwargs)

    return print_to_stdstream


def set_run_dir(run_dir: Path | None) -> None:
    """Where diverted paragraphs go from now on (``run_dir/ray_errors.log``); ``None``: the logger only."""
    global _sink
    with _lock:
        _sink = None if run_dir is None else Path(run_dir) / "ray_errors.log"


def _divert(data: dict[str, Any]) -> None:
    text = "\n".join(str(line) for line in data.get("lines", ()))
    _log.info("Ray: %s", text)
    with _lock:
        sink = _sink
    if sink is not None:
        try:
            with sink.open("a") as f:
                f.write(text.rstrip("\n") + "\n\n")
        except OSError:  # the run directory went away: the logger has it
            pass
