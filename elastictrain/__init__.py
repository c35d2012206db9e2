"""elastictrain: train PyTorch models across many workers on Ray, and keep training through failures.

Public API::

    from elastictrain import Trainer, Task, load_config
    result = Trainer(load_config("jobs/tiny_gpt.yaml")).fit()

- :class:`Trainer` runs a job and returns a :class:`RunResult` (summary, run directory, exit code).
- :class:`Task` is what a user brings: model factory, per-sample loss, optimizer factory, dataset;
  :class:`PipelineHooks` (``Task.pipeline``) says how its model splits into pipeline stages (``parallel.pp``).
- :func:`load_config` / :class:`JobConfig`: the one typed job config; :class:`ConfigError` on bad input.

The names that need torch (``Trainer``, ``RunResult``, ``Task``, ``PipelineHooks``, ``warmup_cosine``) are
imported on first use, so ``import elastictrain`` and the command line's ``--help``, ``ckpt ls`` and
``report`` do not pay for importing torch (~1.5-3 s).
"""

__version__ = "0.1.0"  # before the imports below, so modules they load can read it

from elastictrain.config import ConfigError, JobConfig, build_config, load_config

_LAZY = {"Trainer": "elastictrain.trainer", "RunResult": "elastictrain.trainer", "Task": "elastictrain.task",
         "PipelineHooks": "elastictrain.task", "warmup_cosine": "elastictrain.task"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'elastictrain' has no attribute {name!r}")


__all__ = ["Trainer", "RunResult", "Task", "PipelineHooks", "JobConfig", "ConfigError", "load_config",
           "build_config", "warmup_cosine"]
