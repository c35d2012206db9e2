"""Fresh processes, one per rank, for the tests that build gloo groups themselves (outside Ray).

They fork from one ``forkserver`` process that imported torch, the distributed packages, torch._dynamo
(DDP's constructor imports it) and the worker's modules once for the session (each pytest process: one
per ``-n``), instead of ``spawn`` re-importing them in every process (~3-7 s of CPU each on the 2-core CI
machine, where the ranks of a 4-process test start one after another; with torch._dynamo and the
worker's modules preloaded, the ranks of the gloo test files took 62 s of CPU against 99 s). The fork
server is a clean process started by multiprocessing (no Ray initialized, one thread), so forking it
is safe; each rank still gets
its own interpreter state and its own process group. A rank sees the environment the server was started
with: set what it needs (``MASTER_PORT``, ...) inside the rank, as these tests do."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
            "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.distributed.pipelining",
            # DDP's constructor imports torch._dynamo (sympy, ...): ~0.5 s of CPU in every rank that builds one
            "torch._dynamo", "torch.distributed.checkpoint.state_dict", "elastictrain.worker.actor"]
multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def context() -> multiprocessing.context.BaseContext:
    """The fork-server context (for tests that manage their own ``Process`` objects)."""
    return multiprocessing.get_context("forkserver")


def run_ranks(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes; raises if any of them fails (torch's start_processes)."""
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def run_world(fn: Callable[..., Any], tmp_path: Path, world: int, items: list[Any]) -> list[Any]:
    """``fn(rank, world, items, port, out)`` in ``world`` fresh ranks (a gloo group on a free local port);
    returns what ``fn`` saved to the file ``out`` (``torch.save``; rank 0 saves it in these tests), a list
    with one result per item (a layout, a pair of configs, ...). Raises if any rank fails."""
    import torch

    from tests.checkpoint_fixtures import free_port

    out = str(tmp_path / f"w{world}.pt")
    run_ranks(fn, (world, items, free_port(), out), nprocs=world)
    return torch.load(out)


def join_gloo(rank: int, world: int, port: int, timeout_s: float = 120.0) -> None:
    """Inside a rank: one intra-op thread (as a worker runs) and the gloo group of ``world`` ranks on the
    local ``port``."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def attached_runner(cfg: Any, rank: int, world: int, task: Any = None, audit: bool = True) -> Any:
    """The worker's StepRunner for ``cfg`` (its built-in task unless ``task``), attached as ``rank`` of
    ``world`` in the layout the config resolves to, and seeded as a worker seeds a fresh run."""
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    runner = StepRunner(task or builtin_task(cfg), cfg.train, FaultInjector(()), audit=audit, parallel=cfg.parallel)
    runner.attach(rank, world, 0, resolve(spec_from_config(cfg), world))
    if runner.uninitialized:
        runner.init_from_seed()
    return runner
