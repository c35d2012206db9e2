"""Step records a durable checkpoint carries (issue #40): the reporting rank (rank 0) hands its newest step
records up to the saved step -- those no poll has taken yet, and at least the newest ``CARRIED_MIN`` --
to its save; they land in the manifest as its shard entry's ``records`` (small JSON: losses, tokens,
times), covered by the manifest's digest and signature like the rest.

A recovery from a checkpoint this run committed reports, from them, the steps the restored state holds
whose ``step`` events were never written (``Ledger.replay``). The controller takes every record before
the save's report that commits it (worker ``poll``), so this is the backstop, not the usual path.
PURE: no storage."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from elastictrain.checkpoint.manifest import Manifest, ManifestError

CARRIED_MAX = 64  # records per checkpoint at most: the newest (as the peer tier's snapshots carry)
CARRIED_MIN = 4  # and at least (a poll's reply lost on the way is a few steps): the manifest stays small
# the StepRecord fields a checkpoint keeps, with their JSON types (a number may be an int), and ``pipeline``
# under pp (a few scalars: goodput counts a pp step's ranks by it); the rest (sample ids, per-expert counts,
# memory, mesh) is reporting detail a replayed step goes without
_NUMBERS = ("step_s", "compute_s", "finished_at")
_INTS = ("step", "world_size", "accum", "tokens", "devices")
_OPTIONAL_NUMBERS = ("loss", "eval_loss", "flops_per_token", "peak_flops", "compile_s")


def carry(records: Iterable[Any], up_to: int, keep: int = CARRIED_MAX) -> tuple[dict[str, Any], ...]:
    """The JSON a save of step ``up_to`` carries: of ``records`` (StepRecords, oldest first; a step seen
    twice -- a redo -- keeps its newest), those of steps up to ``up_to``, the newest ``keep``, in step order."""
    newest: dict[int, Any] = {}
    for r in records:
        if r.step <= up_to:
            newest[r.step] = r
    out = []
    for step in sorted(newest)[-keep:] if keep > 0 else []:
        r = newest[step]
        item: dict[str, Any] = {k: getattr(r, k) for k in (*_INTS, *_NUMBERS)}
        for k in _OPTIONAL_NUMBERS:  # strict JSON: a skipped step's non-finite loss is null
            value = getattr(r, k)
            item[k] = None if value is None or not math.isfinite(value) else value
        if r.skipped:
            item["skipped"] = str(r.skipped)
        if r.pipeline:
            item["pipeline"] = dict(r.pipeline)
        out.append(item)
    return tuple(out)


def carried(manifest: Manifest) -> list[Any]:
    """The step records ``manifest`` carries (StepRecords, in step order, none after its step); ``[]`` for
    a checkpoint written without them. Raises :class:`ManifestError` naming the entry when they are not
    what :func:`carry` writes (a hand-edited manifest: the caller reports nothing from it)."""
    from elastictrain.worker.loop import StepRecord

    where = f"checkpoint of step {manifest.step}"
    raw = (manifest.shards.get(0) or {}).get("records", [])
    if not isinstance(raw, list) or len(raw) > CARRIED_MAX:
        raise ManifestError(f"{where}: shard 0's 'records' is not a list of at most {CARRIED_MAX} step records")
    out = []
    for i, item in enumerate(raw):
        out.append(StepRecord(**_checked(item, f"{where}: step record {i}")))
    if [r.step for r in out] != sorted({r.step for r in out}) or any(r.step > manifest.step for r in out):
        raise ManifestError(f"{where}: its step records are not distinct steps in order up to {manifest.step}")
    return out


def to_replay(manifest: Manifest, committed_by_this_run: Sequence[int]) -> list[Any]:
    """The records a recovery from ``manifest`` may report: only a checkpoint this run committed holds
    steps this run trained (a branch point, or a checkpoint of an earlier run of the job, holds steps
    reported, if ever, in another run's events). Raises like :func:`carried`."""
    return carried(manifest) if manifest.step in committed_by_this_run else []


def _checked(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ManifestError(f"{where} is not an object")
    unknown = set(item) - {*_INTS, *_NUMBERS, *_OPTIONAL_NUMBERS, "skipped", "pipeline"}
    if unknown:
        raise ManifestError(f"{where} has unknown fields {sorted(unknown)}")
    for key in (*_INTS, *_NUMBERS, "loss"):
        if key not in item:
            raise ManifestError(f"{where} has no {key!r}")
    for key, value in item.items():
        if key == "skipped":
            ok = isinstance(value, str)
        elif key == "pipeline":
            ok = _pipeline_ok(value)
        elif key in _INTS:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= (1 if key == "step" else 0)
        else:
            ok = (value is None and key in _OPTIONAL_NUMBERS) or (
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
        if not ok:
            raise ManifestError(f"{where}: field {key!r} has an invalid value {value!r}")
    return dict(item)


def _pipeline_ok(value: Any) -> bool:
    """A step's pipeline fields as the loop reports them: a few named scalars, ``pp`` a rank count and
    ``bubble_measured`` a share."""
    if not isinstance(value, dict) or len(value) > 16 or not all(isinstance(k, str) for k in value):
        return False
    if not all(v is None or isinstance(v, (str, int, float)) for v in value.values()):
        return False
    pp, bubble = value.get("pp"), value.get("bubble_measured")
    return (isinstance(pp, int) and not isinstance(pp, bool) and pp >= 1 and isinstance(bubble, (int, float))
            and not isinstance(bubble, bool) and math.isfinite(bubble))
