"""A worker's reply to ``run`` on the wire: a few packed bytes, not a dict.

When a step fails, every survivor's ``run`` call ends at once and the controller takes each reply before it
can decide, so the reply is ``bytes``, which Ray hands over without pickling (the figures:
``docs/perf/2026-11-24-control-plane-scale.md``; ``benchmarks/scale.py --ray-get`` measures it).

Layout: status code (1 byte), has-error flag (1 byte), completed step (int64), slot (int32, -1 for
none), then the error text in UTF-8 (empty when there is none). :func:`unpack` gives back the dict
``{"status", "step", "error", "slot"}`` the controller reads.
"""

from __future__ import annotations

import struct
from typing import Any

STATUSES = ("done", "stopped", "peer_failed", "error")
_CODE = {s: i for i, s in enumerate(STATUSES)}
_HEAD = struct.Struct("<BBqi")


def pack(status: str, step: int, error: str | None = None, slot: int | None = None) -> bytes:
    """The result of a ``run`` call as bytes (``status`` is one of :data:`STATUSES`)."""
    head = _HEAD.pack(_CODE[status], error is not None, int(step), -1 if slot is None else int(slot))
    return head + error.encode() if error is not None else head


def unpack(data: bytes) -> dict[str, Any]:
    """The dict :func:`pack` was given: ``{"status", "step", "error", "slot"}``."""
    code, has_error, step, slot = _HEAD.unpack_from(data)
    return {"status": STATUSES[code], "step": step,
            "error": data[_HEAD.size:].decode(errors="replace") if has_error else None,
            "slot": None if slot < 0 else slot}
