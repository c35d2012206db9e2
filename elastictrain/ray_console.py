"""Ray's own paragraph about a dead worker, kept off the console: the ``failure`` event says it once.

When a worker process dies, Ray publishes an error to the driver ("A worker died or was killed while
executing a task by an unexpected system error ... OOM killer ...") and its error-listener thread prints
it on stdout (``ray._private.worker.listen_error_messages`` -> ``print_to_stdstream``, prefixed
``(raylet)``). For elastictrain a dead worker is an expected, handled failure, already reported by one
``failure`` event; the paragraph reads like a crash. :func:`install` routes these paragraphs to
``RUN_DIR/ray_errors.log`` of the latest run this process started (one can arrive after its run ended)
and to the ``elastictrain.ray`` logger at INFO;
every other message Ray publishes is printed as before. Ray's own session logs are untouched.

The hook replaces the module attribute the listener thread looks up on every message; if a Ray version
moves it, :func:`install` does nothing (the paragraphs show again, nothing breaks).
"""

from __future__ import annotations

import logging
import threading
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
    """Route worker-death paragraphs off the console for this driver process (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        try:
            import ray._private.worker as ray_worker

            original = ray_worker.print_to_stdstream
        except (ImportError, AttributeError):
            return

        def print_to_stdstream(data: dict[str, Any], ignore_prefix: bool) -> None:
            if not is_worker_death(data):
                return original(data, ignore_prefix)
            _divert(data)

        ray_worker.print_to_stdstream = print_to_stdstream
        _installed = True


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
