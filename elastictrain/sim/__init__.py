"""A simulated cluster that drives the real :class:`~elastictrain.controller.controller.Controller` at
thousands of ranks in one process (no torch, no Ray cluster): fake workers "train" by completing steps on
a wall-clock timeline, and faults (a kill, a lost node, a hang, a drain notice) are injected at a step.

:mod:`elastictrain.sim.world` holds the timeline, the fake workers and the :class:`Runtime` the controller
waits through; :mod:`elastictrain.sim.group` the worker group; :mod:`elastictrain.sim.scenarios` the
scenarios of ``benchmarks/scale.py`` and what each measures; :mod:`elastictrain.sim.machine` what the
machine did around a scenario's decision (page faults, switches, the other core's use, steal). The Ray variant: lightweight Ray actors
(:mod:`elastictrain.sim.ray_actors`, no torch import) driven by the real controller over Ray
(:mod:`elastictrain.sim.ray_run`), its recovery timed phase by phase (:mod:`elastictrain.sim.phases`).

The names below are imported on first use: an actor process imports :mod:`elastictrain.sim.ray_actors`
through this package, and must not import torch with the controller's modules.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"SimGroup": "elastictrain.sim.group", "SimWorld": "elastictrain.sim.world"}

__all__ = ["SimGroup", "SimWorld"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
