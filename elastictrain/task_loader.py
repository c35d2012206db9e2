"""The task a job file names: the built-in ``tiny_gpt`` or ``llama``, or ``task.kind: python`` with
``task.entry: "package.module:function"``.

The entry module is imported on the driver, before any Ray resource is requested, from ``sys.path`` plus the
current directory (under ``ray job submit --working-dir .`` that is the shipped copy of the working
directory; Ray puts the same directory on every worker's path, so the Task's callables unpickle there by
reference). A module that cannot be imported, a missing function, or a function that does not return a
:class:`~elastictrain.task.Task` is a :class:`~elastictrain.config.ConfigError` (exit code 2) that names
what was tried.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

from elastictrain.config import ConfigError, JobConfig
from elastictrain.task import Task, builtin_task


def task_from_config(config: JobConfig) -> Task:
    """The :class:`Task` that ``config.task`` names. Raises :class:`ConfigError`."""
    if config.task.kind == "python":
        return load_entry(config.task.entry or "", dict(config.task.args))
    return builtin_task(config)


def _ensure_cwd_on_path() -> str:
    cwd = os.getcwd()
    # `python -m` puts the CWD first; the `elastictrain` console script does not. The working directory that
    # `ray job submit --working-dir` ships is the CWD of the driver.
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    return cwd


def load_entry(entry: str, args: dict[str, Any]) -> Task:
    """Import ``package.module:function`` and call it with ``**args``; the result must be a :class:`Task`."""
    module_name, _, func_name = entry.partition(":")
    where = f"task.entry={entry!r}"
    cwd = _ensure_cwd_on_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(
                f"{where}: no module named {module_name!r} (looked in the working directory {cwd} and on "
                f"sys.path); run from the directory that contains {module_name.split('.')[0]}/ (with ray job "
                "submit: --working-dir pointing there) or install the package") from None
        raise ConfigError(f"{where}: importing {module_name!r} failed: {e} (install what it needs, e.g. "
                          "pip install 'elastictrain[hf]' for the transformers example)") from None
    except Exception as e:  # noqa: BLE001 - any error at import time is the user's module's
        raise ConfigError(f"{where}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise ConfigError(f"{where}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no function "
                          f"{func_name!r}; its functions: {', '.join(found) or 'none'}")
    try:
        task = func(**args)
    except TypeError as e:
        raise ConfigError(f"{where}: calling {func_name}(**task.args) with task.args={args!r} failed: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{where}: {func_name}(**{args!r}) raised {type(e).__name__}: {e}") from None
    if not isinstance(task, Task):
        raise ConfigError(f"{where}: {func_name}() returned {type(task).__name__}, not an elastictrain.Task; "
                          "return Task(model_fn=..., loss_fn=..., optimizer_fn=..., dataset_fn=...)")
    return task


__all__ = ["task_from_config", "load_entry"]
