"""Where the driver runs: a plain process, or a ``ray job submit`` job with a shipped working directory.

Two things depend on it, both decided here at the edge (the CLI), once, before the run starts:

- the **run id** (the key ``checkpoint.resume: auto`` looks under): ``run_id`` in the job file or ``--set``
  wins; otherwise ``ELASTICTRAIN_RUN_ID`` (set by the k8s manifests, so a RayJob retry with a new submission
  id on a fresh cluster continues the same run); otherwise ``name``.
- a **relative checkpoint URI**: outside a Ray working directory it is made absolute against the current
  directory (the submitting user's). Under a Ray working directory the current directory is a per-node
  copy of the package that Ray deletes when unused, so a relative path there is refused on a cluster of
  several nodes (each node would write its own half of every checkpoint) and, on a single node, resolved
  against the home directory of the user Ray runs as, which outlives the package and the job.
- **relative input paths** (``task.data.source``, ``task.init_from``): outside a Ray working directory they
  are made absolute against the current directory too, since the workers open them from the directory their
  Ray was started in (``elastictrain run --ray-address`` to a Ray started elsewhere would not find
  ``./prepared``). Under a Ray working directory they stay relative: every worker runs in its node's copy of
  the shipped package, where a relative path names the shipped copy of the data.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping

from pydantic import ValidationError

from elastictrain.config import ConfigError, JobConfig

RUN_ID_ENV = "ELASTICTRAIN_RUN_ID"
_RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def ray_working_dir(environ: Mapping[str, str]) -> str | None:
    """The runtime_env working_dir this driver was started with (``ray job submit --working-dir``), if any."""
    raw = environ.get(_RAY_JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        runtime_env = (json.loads(raw) or {}).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    wd = runtime_env.get("working_dir")
    return str(wd) if wd else None


def resolve_run_id(config: JobConfig, environ: Mapping[str, str]) -> JobConfig:
    """``config`` with ``run_id`` filled from ``ELASTICTRAIN_RUN_ID`` when the job file leaves it unset."""
    if config.run_id is not None:
        return config
    value = (environ.get(RUN_ID_ENV) or "").strip()
    if not value:
        return config
    try:
        return type(config).model_validate({**config.model_dump(), "run_id": value})
    except ValidationError as e:  # one line naming the variable, the value and the rule
        why = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise ConfigError(f"{RUN_ID_ENV}={value!r} is not a valid run_id: {why}") from None


@dataclass(frozen=True)
class UriDecision:
    """The checkpoint URI to use and, when it was rewritten, a one-line note saying why."""

    uri: str | None
    note: str | None = None


def is_relative_path(uri: str) -> bool:
    return "://" not in uri and not Path(uri).expanduser().is_absolute()


def decide_checkpoint_uri(uri: str | None, *, cwd: str, working_dir: str | None, alive_nodes: int,
                          home: str) -> UriDecision:
    """Pure decision for a checkpoint URI (see the module docstring). Raises :class:`ConfigError`."""
    if uri is None or not is_relative_path(uri):
        return UriDecision(str(Path(uri).expanduser()) if uri and "://" not in uri else uri)
    if working_dir is None:
        return UriDecision(str((Path(cwd) / uri).resolve()))
    if alive_nodes > 1:
        raise ConfigError(
            f"checkpoint.uri={uri!r} is a relative path and this job runs in a Ray working directory "
            f"({working_dir}) on a cluster of {alive_nodes} nodes: every node has its own copy of that "
            "directory, so no node could read the others' shards. Use s3://bucket/prefix or an absolute path "
            "on a mount every node shares (Lustre/FSx, NFS), e.g. --set checkpoint.uri=s3://my-bucket/ckpt")
    target = str((Path(home) / uri).resolve())
    return UriDecision(target, f"checkpoint.uri={uri!r} is relative and the job runs in a Ray working directory "
                               f"(a temporary per-node copy): using {target} on this single-node cluster")


def absolute_input(path: str | None, *, cwd: str, working_dir: str | None) -> str | None:
    """PURE: a relative local input path (a corpus, a model directory) made absolute against ``cwd`` when
    the driver runs outside a Ray working directory; ``builtin:`` names, URLs, absolute paths and anything
    under a working directory unchanged."""
    if path is None or working_dir is not None or path.startswith("builtin:") or not is_relative_path(path):
        return path
    return str((Path(cwd) / Path(path).expanduser()).resolve())


def resolve_for_driver(config: JobConfig, environ: Mapping[str, str], alive_nodes: int | None = None,
                       ) -> tuple[JobConfig, list[str]]:
    """Apply :func:`resolve_run_id`, :func:`decide_checkpoint_uri` and :func:`absolute_input`; return the config
    and notes to print.

    ``alive_nodes`` is only needed (and only asked of Ray when ``None``) for a relative checkpoint URI under
    a Ray working directory; counting nodes connects to the cluster but requests no resources.
    """
    config = resolve_run_id(config, environ)
    uri = config.checkpoint.uri
    working_dir = ray_working_dir(environ)
    if uri is not None and is_relative_path(uri) and working_dir is not None and alive_nodes is None:
        alive_nodes = _count_alive_nodes()
    decision = decide_checkpoint_uri(uri, cwd=os.getcwd(), working_dir=working_dir, alive_nodes=alive_nodes or 1,
                                     home=str(Path.home()))
    data = config.model_dump()
    data["checkpoint"]["uri"] = decision.uri
    task = data["task"]
    task["data"]["source"] = absolute_input(task["data"]["source"], cwd=os.getcwd(), working_dir=working_dir)
    task["init_from"] = absolute_input(task["init_from"], cwd=os.getcwd(), working_dir=working_dir)
    if data != config.model_dump():
        config = type(config).model_validate(data)
    return config, [decision.note] if decision.note else []


def _count_alive_nodes() -> int:
    import logging

    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", logging_level=logging.WARNING)
    return sum(1 for n in ray.nodes() if n.get("Alive"))


__all__ = ["RUN_ID_ENV", "resolve_run_id", "decide_checkpoint_uri", "resolve_for_driver", "ray_working_dir"]
