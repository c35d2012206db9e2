"""Where a run keeps its checkpoints and what it resumes from: decided once on the driver, before Ray.

Rules (docs/config.md, ``checkpoint.resume``):

* A run's checkpoints live under ``<checkpoint.uri>/<run id>``; the run id is ``run_id`` (default ``name``).
* ``auto``: continue the newest committed checkpoint of that root whose files are present with their
  recorded sizes (the ranks check the SHA-256 of what they read). Committed checkpoints that are all
  damaged (or whose manifests are all refused: tampered, unsigned under a signing key) are an error, not
  a silent fresh start over them.
* ``never``: a fresh trajectory. If the root already holds step directories, the run takes a new unique
  run id ``<run id>-<UTC time>-<4 hex>`` (printed, recorded in the manifest and the summary), so it never
  writes into, deletes from, or falls back to another run's checkpoints.
* an explicit step URI: continue from it; the run keeps its own root only when that root holds nothing
  newer of another trajectory, else it takes a new unique run id as above.

Every fresh start gets a new ``lineage`` id; a resume inherits the checkpoint's. Retention and the
durable fallback only touch checkpoints of the run's own lineage.

Compatibility: the driver part of the job fingerprint (:mod:`elastictrain.checkpoint.compat`) is compared
here; the model/optimizer/data part when the first worker has built them. A resume at or past
``train.steps`` is "already finished": nothing runs, exit 0.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from elastictrain.checkpoint import storage
from elastictrain.checkpoint.compat import compare, driver_fingerprint, lineage_of, refusal
from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.manifest import Manifest
from elastictrain.checkpoint.store import CheckpointStore


@dataclass(frozen=True)
class ResumeDecision:
    """What :func:`plan_resume` decided. ``run_id`` is the effective run id (the checkpoint root's name)."""

    run_id: str
    store: CheckpointStore | None = None
    manifest: Manifest | None = None
    lineage: str | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)
    note: str | None = None          # why the run id changed, for the console and the events
    finished: bool = False           # the checkpoint is already at or past train.steps

    @property
    def root_uri(self) -> str | None:
        return self.store.root_uri if self.store is not None else None


def unique_run_id(run_id: str, now: float) -> str:
    return f"{run_id}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{secrets.token_hex(2)}"


def new_lineage() -> str:
    return uuid.uuid4().hex[:12]


def plan_resume(config: Any, lr_fn: Any, builtin_task: bool, now: float | None = None) -> ResumeDecision:
    """Decide the run id, store, resume checkpoint and lineage of a run. Raises CheckpointError (exit 3)
    with the reason and the ways out."""
    c, run_id = config.checkpoint, config.stable_id
    fp = driver_fingerprint(config, lr_fn, builtin_task)
    if c.uri is None:
        return ResumeDecision(run_id, fingerprint=fp)
    now = time.time() if now is None else now
    opts = dict(c.storage_options)
    store = CheckpointStore(storage.join(c.uri.rstrip("/"), run_id), opts)
    if c.resume == "never":
        if not store.has_step_dirs():
            return ResumeDecision(run_id, store, None, new_lineage(), fp)
        return _fresh_elsewhere(config, run_id, now, fp, f"checkpoint.resume=never and {store.root_uri} already "
                                                         "holds checkpoints of another run")
    if c.resume == "auto":
        manifest, skipped = store.latest_valid(checksums=False)
        if manifest is None:
            damaged = sorted([m.step for m in store.committed()] + list(store.refused()))
            if damaged:
                raise CheckpointError(
                    f"checkpoint.resume=auto: every committed checkpoint under {store.root_uri} (steps "
                    f"{damaged}) is damaged: {'; '.join(skipped)}. Ways out: repair or remove them, point "
                    "checkpoint.resume at a good step directory, sign the ones you trust (elastictrain ckpt sign), "
                    "or start fresh with --set checkpoint.resume=never")
            return ResumeDecision(run_id, store, None, new_lineage(), fp)
        return _checked(config, ResumeDecision(run_id, store, manifest, lineage_of(manifest.meta) or new_lineage(), fp),
                        lr_fn)
    manifest = store.resolve(c.resume)
    if manifest is None:
        raise CheckpointError(f"checkpoint.resume={c.resume!r} resolved to no checkpoint")
    conflicts = [m for m in store.committed()
                 if m.step > manifest.step or lineage_of(m.meta) != lineage_of(manifest.meta)]
    if manifest.location.rstrip("/").rsplit("/", 1)[0] == store.root_uri and not conflicts:
        plan = ResumeDecision(run_id, store, manifest, lineage_of(manifest.meta) or new_lineage(), fp)
    elif not store.has_step_dirs():
        plan = ResumeDecision(run_id, store, manifest, new_lineage(), fp)
    else:
        fresh = _fresh_elsewhere(config, run_id, now, fp, f"{store.root_uri} holds checkpoints of another "
                                                          f"trajectory than {manifest.location}")
        plan = ResumeDecision(fresh.run_id, fresh.store, manifest, fresh.lineage, fp, fresh.note)
    return _checked(config, plan, lr_fn)


def _fresh_elsewhere(config: Any, run_id: str, now: float, fp: dict[str, Any], why: str) -> ResumeDecision:
    c = config.checkpoint
    new_id = unique_run_id(run_id, now)
    store = CheckpointStore(storage.join(c.uri.rstrip("/"), new_id), dict(c.storage_options))
    note = f"{why}: this run uses the new run id {new_id} (checkpoints under {store.root_uri})"
    return ResumeDecision(new_id, store, None, new_lineage(), fp, note)


def _checked(config: Any, plan: ResumeDecision, lr_fn: Any) -> ResumeDecision:
    m = plan.manifest
    saved = m.meta.get("fingerprint")
    finished = m.step >= config.train.steps
    if saved is None:  # a checkpoint from before fingerprints: the old data-order check
        saved = {"train.global_batch": m.meta.get("global_batch"), "train.seed": m.meta.get("seed")}
        saved = {k: v for k, v in saved.items() if v is not None}
    diffs = compare(saved, plan.fingerprint, lr_fn, keys=("schedule", "train.global_batch", "train.seed", "task"))
    if finished:  # a shorter train.steps only shortens the schedule of a run that is over anyway
        diffs = [d for d in diffs if d.key != "schedule"]
    why = refusal(diffs, config.checkpoint.accept_changes, m.location, plan.run_id)
    if why:
        raise CheckpointError(why)
    return ResumeDecision(plan.run_id, plan.store, m, plan.lineage, plan.fingerprint, plan.note, finished)
