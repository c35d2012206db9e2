"""The user-facing log: ``events.jsonl`` (one JSON object a line, appended as things happen) and a
readable console line for each event.

Every record has ``event`` (a name from :data:`EVENTS`) and ``time`` (Unix seconds). Observers may read
the log; nothing in it changes state. The format is documented in docs/events.md; keep it stable.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

# The goodput buckets summary.json reports (every one, 0 when a run spent nothing there) besides ``other_s``.
GOODPUT_BUCKETS = ("productive_s", "degraded_s", "startup_s", "detection_s", "recovery_s", "redone_s",
                   "compile_s", "checkpoint_stall_s")

EVENTS = (
    "run_started", "worker_started", "generation_started", "resumed", "step", "checkpoint_saved",
    "checkpoint_skipped", "checkpoint_failed", "failure", "recovered", "replanned", "resized", "straggler",
    "preempted", "worker_lost", "run_finished", "run_failed", "warning", "peer_tier_short",
    "memory_snapshot_rejected", "memory_snapshot_dropped", "step_skipped", "stall_aborted", "data_stalled", "profile_saved",
)

# Events that a person wants on the console even when step lines are thinned out.
_QUIET = {"step"}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class EventLog:
    """Appends events to ``run_dir/events.jsonl`` and echoes a line to the console.

    Thread-safe. Step events are echoed every ``log_every`` steps, and when the console is not a terminal at
    most every ``min_interval_s`` seconds, so logs of long jobs stay readable.
    """

    def __init__(
        self, run_dir: Path, *, console: TextIO | None = sys.stdout, log_every: int = 1,
        min_interval_s: float = 5.0,
    ) -> None:
        self.path = Path(run_dir) / "events.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._console = console
        self._lock = threading.Lock()
        self._log_every = log_every
        self._is_tty = bool(console is not None and getattr(console, "isatty", lambda: False)())
        self._min_interval = 0.0 if self._is_tty else min_interval_s
        self._last_step_echo = 0.0
        self.records: list[dict[str, Any]] = []
        self.listeners: list[Any] = []  # observers: called with each record; they never change state

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        if event not in EVENTS:
            raise ValueError(f"unknown event {event!r}; add it to elastictrain.events.EVENTS and docs/events.md")
        record = {"event": event, "time": round(time.time(), 6), **_jsonable(fields)}
        with self._lock:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self.records.append(record)
            self._echo(record)
        for listener in self.listeners:
            listener(record)
        return record

    def _echo(self, record: dict[str, Any]) -> None:
        if self._console is None:
            return
        if record["event"] in _QUIET:
            now = time.monotonic()
            step = record.get("step", 0)
            final = record.get("final", False)
            if not final and (step % self._log_every or now - self._last_step_echo < self._min_interval):
                return
            self._last_step_echo = now
        print(format_event(record), file=self._console, flush=True)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


def format_event(r: dict[str, Any]) -> str:
    """One readable console line for an event record."""
    name = r["event"]
    stamp = time.strftime("%H:%M:%S", time.localtime(r["time"]))
    if name == "step":
        eta = r.get("eta_s")
        eta_txt = f" eta {eta:.0f}s" if isinstance(eta, (int, float)) else ""
        loss = r.get("loss")
        loss_txt = f"{loss:.4f}" if isinstance(loss, (int, float)) else "non-finite (update skipped)"
        return (
            f"[{stamp}] step {r['step']}/{r.get('total_steps', '?')} loss {loss_txt} "
            f"world {r['world_size']} {r.get('samples_per_s', 0):.1f} samples/s{eta_txt}"
            + (f" eval_loss {r['eval_loss']:.4f}" if r.get("eval_loss") is not None else "")
        )
    skip = {"event", "time"}
    detail = " ".join(f"{k}={v}" for k, v in r.items() if k not in skip and k != "reason")
    reason = f" -- {r['reason']}" if r.get("reason") else ""
    return f"[{stamp}] {name} {detail}{reason}"


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` atomically (temp file + rename)."""
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The events of ``run_dir/events.jsonl``, also while a run writes it: every record ends with a
    newline, so text after the last one is a record still being written (a reader can see part of one
    write) and is not read yet."""
    path = Path(run_dir) / "events.jsonl"
    complete = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in complete.split("\n") if line.strip()]
