"""PURE: the job fingerprint a checkpoint stores, and the comparison a resume makes against it.

A checkpoint continues a trajectory only if the job that resumes it would compute the same thing. The
fingerprint (``manifest.meta["fingerprint"]``) holds one entry per thing that defines the trajectory:

* ``model``: names, shapes and dtypes of the module's state dict (a hash and a count);
* ``optimizer``: the optimizer class and each parameter group's size and hyper-parameters;
* ``schedule``: the learning-rate multiplier at up to 33 steps spread over ``[0, train.steps)``, so a
  changed ``train.steps`` counts only where it changes the schedule (a constant schedule extends freely);
* ``train.global_batch``, ``train.seed``: they define which samples each step sees;
* ``data``: the dataset fingerprint (length + a content hash of sampled items, :mod:`elastictrain.data.fingerprint`);
* ``task``: the built-in task's settings (model sizes, dropout, data source, gradient clip, and
  ``task.init_from``'s URI when set: a resume whose job names another source is a changed ``task``); absent for
  user tasks (the optimizer settings are covered by ``optimizer`` and ``schedule``).

``model``, ``optimizer`` and ``data`` are computed where the objects are built (in each worker's setup);
the others on the driver from the config. :func:`compare` returns the differences with a readable line each;
the caller refuses the resume (exit 3) unless the user accepted exactly those keys
(``checkpoint.accept_changes``). ``model``, ``train.global_batch`` and ``train.seed`` can never be accepted:
the state would not load, or the data position would mean other samples.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a model is fingerprinted (the workers), not by the CLI
    import torch

# Keys a user may accept as changed (checkpoint.accept_changes); the others always refuse.
ACCEPTABLE = ("schedule", "optimizer", "data", "task")
DRIVER_KEYS = ("schedule", "train.global_batch", "train.seed", "task")
WORKER_KEYS = ("model", "optimizer", "data")
_SCHEDULE_POINTS = 33


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def model_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """Names, shapes and dtypes of ``model.state_dict()`` (no values): what a checkpoint must match to load."""
    import torch

    layout = [[name, list(t.shape), str(t.dtype)] for name, t in sorted(model.state_dict().items())
              if isinstance(t, torch.Tensor)]
    return {"tensors": len(layout), "numel": sum(int(torch.Size(s).numel()) for _, s, _ in layout),
            "sha256": _digest(layout)}


def optimizer_fingerprint(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Class and, per parameter group, its size and hyper-parameters (``lr`` is the base value at build)."""
    groups = [{"params": len(g["params"]), **{k: v for k, v in sorted(g.items()) if k != "params"}}
              for g in optimizer.param_groups]
    return {"class": type(optimizer).__qualname__, "sha256": _digest(groups)}


def schedule_fingerprint(lr_fn: Callable[[int], float] | None, steps: int) -> list[list[float]]:
    """``[[step, multiplier], ...]`` at up to 33 steps spread over ``[0, steps)``; ``[]`` for no schedule."""
    if lr_fn is None:
        return []
    points = sorted({round(i * (steps - 1) / (_SCHEDULE_POINTS - 1)) for i in range(_SCHEDULE_POINTS)})
    return [[p, float(lr_fn(p))] for p in points]


def driver_fingerprint(config: Any, lr_fn: Callable[[int], float] | None, builtin_task: bool) -> dict[str, Any]:
    """The part of the fingerprint the driver knows from the config and the task's schedule."""
    fp: dict[str, Any] = {
        "schedule": schedule_fingerprint(lr_fn, config.train.steps),
        "train.global_batch": config.train.global_batch,
        "train.seed": config.train.seed,
    }
    if builtin_task:
        task = config.task.model_dump(mode="json")
        task["data"].pop("storage_options", None)  # credentials never reach a manifest
        task.pop("init_from_storage_options", None)
        # keys a job does not use stay out, so a tiny_gpt checkpoint from before they existed still compares equal
        if task.get("init_from") is None:
            task.pop("init_from", None)
        if task["kind"] != "llama":
            task.pop("llama", None)
        if task["model"].get("vocab_size") is None:
            task["model"].pop("vocab_size", None)
        # the optimizer's settings are judged by `optimizer` (hyper-parameters) and `schedule` (warm-up);
        # only the gradient clip is the task's own
        task["grad_clip"] = task.pop("optimizer")["grad_clip"]
        fp["task"] = task
    return fp


@dataclass(frozen=True)
class Difference:
    key: str
    line: str


def _schedule_difference(saved: list, lr_fn: Callable[[int], float] | None) -> str | None:
    for step, then in saved:
        now = float(lr_fn(int(step))) if lr_fn is not None else 1.0
        if abs(now - then) > 1e-9 * max(1.0, abs(then)):
            return (f"schedule: the learning-rate multiplier at step {int(step)} was {then:.4g}, now {now:.4g} "
                    "(train.steps or the warm-up changed the LR schedule)")
    return None


def compare(saved: dict[str, Any], now: dict[str, Any], lr_fn: Callable[[int], float] | None = None,
            keys: Iterable[str] = DRIVER_KEYS + WORKER_KEYS) -> list[Difference]:
    """Differences between the fingerprint ``saved`` in a checkpoint and the job's ``now``, for ``keys``.

    A key absent from either side is not compared (old checkpoints, user tasks without a ``task`` entry).
    ``schedule`` is compared by evaluating ``lr_fn`` at the saved steps."""
    out = []
    for key in keys:
        if key not in saved or key not in now:
            continue
        if key == "schedule":
            line = _schedule_difference(saved["schedule"], lr_fn)
            if line:
                out.append(Difference(key, line))
        elif saved[key] != now[key]:
            out.append(Difference(key, f"{key}: {_short(saved[key])} in the checkpoint, {_short(now[key])} now"))
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=repr)
    return text if len(text) <= 120 else text[:117] + "..."


def refusal(differences: list[Difference], accepted: Iterable[str], where: str, run_id: str) -> str | None:
    """The exit-3 message when ``differences`` hold a key the user did not accept; ``None`` to go on."""
    accepted = set(accepted)
    refused = [d for d in differences if d.key not in accepted or d.key not in ACCEPTABLE]
    if not refused:
        return None
    keys = sorted({d.key for d in refused})
    acceptable = [k for k in keys if k in ACCEPTABLE]
    ways = ["use the checkpoint's values", "start fresh with --set checkpoint.resume=never (a new run id) "
            "or a new run_id"]
    if acceptable and len(acceptable) == len(keys):
        ways.insert(1, f"continue this run with the change on purpose: --set 'checkpoint.accept_changes="
                       f"[{','.join(acceptable)}]'")
    return (f"the job differs from the checkpoint it would resume ({where}, run {run_id}): "
            + "; ".join(d.line for d in refused) + ". Ways out: " + "; or ".join(ways))


def lineage_of(meta: dict[str, Any]) -> str | None:
    """The trajectory a committed checkpoint belongs to (older manifests: their run id)."""
    return meta.get("lineage") or meta.get("run_id")
