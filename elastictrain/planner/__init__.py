"""The planner: a cost model of memory and step time for every parallel layout, and the search that ranks
them (issue 24). Pure modules: :mod:`.inputs` (what it takes), :mod:`.memory`, :mod:`.comm`, :mod:`.pipeline`
and :mod:`.steptime` (the model), :mod:`.search` (candidates, ranking, what may run), :mod:`.explain` (the
answer in words), :mod:`.accuracy` (the benchmark's ranking verdict and its tie rule). :mod:`.cluster` (what
Ray or this machine offers), :mod:`.calibrate` (measured figures) and :mod:`.job` (a job config in, a layout
out) are the edges."""

from elastictrain.planner.inputs import GB, GIB, Candidate, Cluster, ModelShape, PlannerInputError, Training
from elastictrain.planner.memory import Memory, memory
from elastictrain.planner.search import Estimate, evaluate, rank_layouts, rank, runnable_axes, why_invalid
from elastictrain.planner.steptime import StepTime, step_time

__all__ = ["GB", "GIB", "Candidate", "Cluster", "Estimate", "Memory", "ModelShape", "PlannerInputError",
           "StepTime", "Training", "evaluate", "memory", "rank", "rank_layouts", "runnable_axes", "step_time",
           "why_invalid"]
