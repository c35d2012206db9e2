"""elastictrain: train PyTorch models across many workers on Ray, and keep training through failures.

Public API::

    from elastictrain import Trainer, Task, load_config
    result = Trainer(load_config("jobs/tiny_gpt.yaml")).fit()

- :class:`Trainer` runs a job and returns a :class:`RunResult` (summary, run directory, exit code).
- :class:`Task` is what a user brings: model factory, per-sample loss, optimizer factory, dataset.
- :func:`load_config` / :class:`JobConfig`: the one typed job config; :class:`ConfigError` on bad input.
"""

from elastictrain.config import ConfigError, JobConfig, build_config, load_config
from elastictrain.task import Task, warmup_cosine
from elastictrain.trainer import RunResult, Trainer

__all__ = ["Trainer", "RunResult", "Task", "JobConfig", "ConfigError", "load_config", "build_config",
           "warmup_cosine"]
__version__ = "0.1.0"
