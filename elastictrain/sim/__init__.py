"""A simulated cluster that drives the real :class:`~elastictrain.controller.controller.Controller` at
thousands of ranks in one process (no torch, no Ray cluster): fake workers "train" by completing steps on
a wall-clock timeline, and faults (a kill, a lost node, a hang, a drain notice) are injected at a step.

:mod:`elastictrain.sim.world` holds the timeline, the fake workers and the :class:`Runtime` the controller
waits through; :mod:`elastictrain.sim.group` the worker group; :mod:`elastictrain.sim.scenarios` the
scenarios of ``benchmarks/scale.py`` and what each measures.
"""

from elastictrain.sim.group import SimGroup
from elastictrain.sim.world import SimWorld

__all__ = ["SimGroup", "SimWorld"]
