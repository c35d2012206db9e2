"""Checks on the driver before any Ray resource is requested: what can be known to fail on every worker,
or to never start, is reported once, as a config error (exit 2), instead of as N workers' set-up failures
or a wait that cannot end.

Only cheap facts are checked: a local data path (a remote data URL is left to the workers: the driver may
have no credentials for it, and the workers' set-up errors are quoted anyway), the GPUs of this machine
when the job runs on a local Ray started here, the GPU types of the cluster against ``parallel.float8``, and
whether anything answers at the Ray address (one TCP connect of at most 5 s).
"""

from __future__ import annotations

import glob
import socket
from collections.abc import Sequence
from pathlib import Path

from elastictrain.config import ConfigError, JobConfig

_GLOB_CHARS = ("*", "?", "[")


def _local_path(source: str) -> str | None:
    """The filesystem path of a local ``source`` (plain path or ``file://``), else None."""
    if source.startswith("builtin:"):
        return None
    if source.startswith("file://"):
        return source[len("file://"):]
    if "://" in source or "::" in source:
        return None
    return source


def check_data_source(source: str, key: str = "task.data.source") -> None:
    """Raise ConfigError when a local data source names nothing: a missing file or directory, a glob that
    matches no file, or a directory without ``.parquet`` files or a prepared corpus's ``manifest.json``."""
    path = _local_path(source)
    if path is None:
        return
    if any(ch in path for ch in _GLOB_CHARS):
        if not [p for p in glob.glob(path, recursive=True) if Path(p).is_file()]:
            raise ConfigError(f"{key}={source!r}: the glob matches no file on this machine; fix the path")
        return
    p = Path(path)
    if p.is_dir():
        if (p / "manifest.json").is_file():  # a prepared corpus (elastictrain data prepare)
            return
        if not any(p.rglob("*.parquet")):
            raise ConfigError(f"{key}={source!r}: the directory holds no .parquet file; point it at Parquet data")
        return
    if not p.exists():
        raise ConfigError(f"{key}={source!r}: no such file or directory on this machine (workers read it "
                          "too: use a path that exists everywhere, or a URL such as s3://...)")


def check_local_gpus(config: JobConfig, gpus: int) -> None:
    """Raise ConfigError when ``workers.use_gpu`` asks a private local Ray (started by this driver: no
    autoscaler will ever add a GPU) for more GPUs than this machine has (``gpus``: what torch sees here, the
    same torch the local workers import). Without it the run would wait ``timeouts.restart_grace_s`` for a
    placement that cannot happen. A cluster (``--ray-address``/``RAY_ADDRESS``) is not checked: it may grow."""
    w = config.workers
    if w.use_gpu and gpus < w.min:
        raise ConfigError(
            f"workers.use_gpu=true: each worker takes one GPU and workers.min={w.min} must start, but this "
            f"machine has {gpus} that torch can use, and the job runs on a local Ray started here (no cluster "
            "to grow): set workers.use_gpu=false, lower workers.min, or pass --ray-address of a cluster with GPUs")


def check_plan_on_gpus(config: JobConfig, gpus_per_node: int | None) -> None:
    """Raise ConfigError when hsdp on GPUs, with ``parallel.shard_size`` unset, takes a node's GPUs
    (``gpus_per_node``, the smallest GPU node of the cluster) as its shard group and ``workers.min`` or
    ``workers.max`` is not a whole number of such groups. The config check cannot know the GPUs of a node;
    without this one every worker would start before the first rendezvous found no usable world size."""
    from elastictrain.parallel.layout import is_valid, spec_from_config

    p, w = config.parallel, config.workers
    if p.plan != "hsdp" or not w.use_gpu or p.shard_size is not None or not gpus_per_node:
        return
    spec = spec_from_config(config, gpus_per_node)
    bad = [(name, n) for name, n in (("workers.min", w.min), ("workers.max", w.max)) if not is_valid(spec, n)[0]]
    if bad:
        name, n = bad[0]
        raise ConfigError(
            f"parallel.shard_size is unset, so hsdp shards over the {gpus_per_node} GPUs of a node, but {name}="
            f"{n} is not usable with it ({is_valid(spec, n)[1]}): set parallel.shard_size to a size that "
            f"divides workers.min and workers.max, or make them multiples of {gpus_per_node}")


def check_float8_gpus(config: JobConfig, gpu_types: Sequence[str]) -> None:
    """PURE. Raise ConfigError when ``parallel.float8`` asks for float8 matmuls on a cluster whose GPU nodes
    (``gpu_types``: Ray's ``accelerator_type`` of each alive GPU node) are all of types the device table
    (:mod:`elastictrain.devices`) knows to lack them (compute capability below 8.9: an A100). A cluster with
    one capable or unknown type passes: the worker's own check (``parallel/speed.py`` ``float8_unavailable``,
    a ``setup_failed`` naming why) covers what the driver cannot know."""
    from elastictrain.devices import lookup

    if not config.parallel.float8 or not config.workers.use_gpu or not gpu_types:
        return
    devices = [lookup(t) for t in gpu_types]
    if any(d is None or d.float8 is not False for d in devices):
        return
    seen = sorted({f"{t} (compute capability {d.capability[0]}.{d.capability[1]})"  # type: ignore[union-attr,index]
                   for t, d in zip(gpu_types, devices, strict=True)})
    raise ConfigError(f"parallel.float8=true needs GPUs of compute capability >= 8.9 (H100, H200, L40S, ...); "
                      f"this cluster's GPUs are {', '.join(seen)}; set parallel.float8=false")


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """PURE. ``(host, port)`` that a Ray ``address`` connects to first (``host:port`` or ``ray://host:port``);
    None for the addresses Ray resolves itself (``auto``, ``local``) or cannot be parsed here."""
    rest = address.strip()
    if "://" in rest:
        rest = rest.split("://", 1)[1]
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_ray_address(address: str, where: str, timeout_s: float = 5.0) -> None:
    """Raise ConfigError when nothing answers at a Ray cluster ``address`` (given by ``where``: the option
    or variable). Ray's own connect waits without end for a refused local port (``127.0.0.1:<closed>``,
    Ray 2.60); a TCP connect says it in at most ``timeout_s``."""
    endpoint = ray_endpoint(address)
    if endpoint is None:
        return
    try:
        socket.create_connection(endpoint, timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(unreachable_ray(address, where, e.strerror or type(e).__name__)) from None


def unreachable_ray(address: str, where: str, why: str) -> str:
    """The one line for a Ray cluster that cannot be reached."""
    return (f"cannot reach a Ray cluster at {address!r} ({where}): {why}; start one (`ray start --head`), fix the "
            "address, or leave --ray-address and RAY_ADDRESS unset to run on a local Ray started for this job")


def check_job(config: JobConfig, builtin_task: bool = True) -> None:
    """Every pre-flight check of a job; raises ConfigError naming the field, the value and the fix.
    ``builtin_task`` False: a user Task brings its own data, so ``task.*`` is not checked."""
    if builtin_task:
        check_data_source(config.task.data.source)
