"""The layout-agnostic training state of one rank: model + optimizer + step + data cursor.

:meth:`TrainingState.state_dict` is what every restore path moves: the durable checkpoint (DCP save/load
through the manifest commit protocol), and any other ``torch.distributed.checkpoint`` StorageReader (an
in-memory tier). It is DCP-shaped: ``{"model": ..., "optim": ..., "progress": {...}}`` where model and
optimizer entries are plain tensors (DDP, replicated) or DTensors (FSDP2/HSDP, this rank's shard), keyed by
parameter name through ``torch.distributed.checkpoint.state_dict`` (identical under DDP, FSDP2, HSDP and
activation checkpointing, so a state saved under one layout loads under another). ``progress`` holds the
step and the data cursor as int64 tensors: DCP stores them without pickling, and a restore checks that the
cursor defines the same data order (a different global batch, seed or dataset fails loudly).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from elastictrain.checkpoint.dcp_quiet import quiet_single_process_notice
from elastictrain.data.cursor import CursorState
from elastictrain.parallel.optim import init_state

_PROGRESS_KEYS = ("step", "global_batch", "seed", "dataset_len")


@functools.cache
def _state_dict_api() -> ModuleType:
    """``torch.distributed.checkpoint.state_dict``, imported on the first state moved rather than by every
    worker's start (this module is on the worker actor's import chain; a worker that never saves, loads or
    syncs never needs DCP: tests/test_worker_preload.py)."""
    import torch.distributed.checkpoint.state_dict as api

    return api


@functools.cache
def _sharded() -> Any:
    """The options of every sharded (per-rank) state dict here: DTensors stay sharded, tensors stay put."""
    api = _state_dict_api()
    return api.StateDictOptions(full_state_dict=False, cpu_offload=False)


def model_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` keyed by parameter name (DTensors stay sharded); a fresh optimizer's
    state is materialised (``parallel.optim.init_state``) so a load has tensors to fill. Works for plain,
    DDP and FSDP2 modules."""
    if optimizer is None:
        return {"model": _state_dict_api().get_model_state_dict(model, options=_sharded())}
    init_state(optimizer)
    model_sd, optim_sd = _state_dict_api().get_state_dict(model, optimizer, options=_sharded())
    return {"model": model_sd, "optim": optim_sd}


def load_model_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    """Put ``state`` (shaped like :func:`model_optim_state`, filled by a load) into the live objects."""
    if optimizer is None or "optim" not in state:
        _state_dict_api().set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={},
                                         options=_sharded())
        return
    _state_dict_api().set_state_dict(model, optimizer, model_state_dict=state["model"],
                                     optim_state_dict=state["optim"], options=_sharded())


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.untyped_storage().data_ptr()


def aliases_live_state(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether every tensor of ``state["model"]`` and ``state["optim"]["state"]`` (as
    :func:`model_optim_state` built it) shares storage with the live model's parameters and buffers or the
    optimizer's state, so that writing into it wrote into them. Empty tensors (a rank's empty shard) have no
    storage to compare and count as aliased."""
    if optimizer is None or "optim" not in state or "param_groups" not in state["optim"]:
        return False
    live = {_storage(t) for t in model.parameters()} | {_storage(t) for t in model.buffers()}
    live |= {_storage(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)}
    saved = list(state["model"].values())
    saved += [v for s in state["optim"].get("state", {}).values() for v in s.values()]
    return all(not isinstance(t, torch.Tensor) or t.numel() == 0 or _storage(t) in live for t in saved)


def load_param_groups(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Put the hyperparameters of ``groups`` (a state dict's ``param_groups``, in the optimizer's group
    order) into ``optimizer``'s groups, as ``Optimizer.load_state_dict`` does, parameters aside."""
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the state has {len(groups)} parameter groups, the optimizer {len(optimizer.param_groups)}")
    for live, saved in zip(optimizer.param_groups, groups):
        live.update({k: v for k, v in saved.items() if k != "params"})


class TrainingState:
    """Model, optimizer, completed steps and data cursor of one rank, whatever the layout.

    ``model`` is the parallelized module (plain, DDP or FSDP2); ``cursor`` the run's data order at step 0
    (its ``step`` is ignored: ``step`` here is the truth).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, cursor: CursorState, step: int = 0):
        self.model = model
        self.optimizer = optimizer
        self.cursor = cursor
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        """The DCP-shaped state (see the module doc). Tensors alias the live ones: stage before mutating."""
        out = model_optim_state(self.model, self.optimizer)
        c = self.cursor
        values = {"step": self.step, "global_batch": c.global_batch, "seed": c.seed, "dataset_len": c.dataset_len}
        out["progress"] = {k: torch.tensor(v, dtype=torch.int64) for k, v in values.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state`` (as :meth:`state_dict` shapes it). Raises CursorError if its data order differs."""
        self._check_cursor(state)
        load_model_optim_state(self.model, self.optimizer, state)
        self.step = int(state["progress"]["step"])

    def _check_cursor(self, state: dict[str, Any]) -> None:
        theirs = CursorState(**{k: int(state["progress"][k]) for k in _PROGRESS_KEYS})
        self.cursor.check_compatible(theirs)

    def load_from(self, reader: Any) -> int:
        """Fill this state from any DCP ``StorageReader`` (durable checkpoint, in-memory snapshots): DCP
        reshards into this rank's layout. Collective-free: a load's global plan is each rank's own
        (``create_default_global_load_plan`` leaves the local plans as they are), so DCP's two rounds of
        pickled plans over the group add nothing but their latency (docs/perf/2026-11-23-code-figures.md).
        A rank's read error is raised on that rank. Returns the restored step.

        DCP loads into the state dict's tensors in place, and those alias the live parameters, buffers and
        optimizer state (:func:`aliases_live_state`): then only the optimizer's hyperparameters are put
        back, not every tensor copied onto itself through ``set_state_dict`` (one DTensor dispatch per
        tensor, each deciding its sharding afresh on a new mesh: docs/perf/2026-11-23-code-figures.md).
        Where anything does not alias, ``set_state_dict`` loads it all."""
        import torch.distributed.checkpoint as dcp

        from elastictrain.checkpoint.safe_bytes import SafeLoadPlanner

        target = self.state_dict()
        # asked first: a refused .metadata raises its own one-line error here, where inside dcp.load DCP
        # would log a traceback per rank and retry with rank-local metadata (a durable reader reads it once)
        reader.read_metadata()
        # non-tensor entries as plain data only: a durable reader refuses any other planner (safe_bytes.py)
        quiet_single_process_notice()  # no group on purpose: DCP's notice saying so is noise
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        if aliases_live_state(target, self.model, self.optimizer):
            self._check_cursor(target)
            load_param_groups(self.optimizer, target["optim"]["param_groups"])
            self.step = int(target["progress"]["step"])
        else:
            self.load_state_dict(target)
        return self.step

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The whole model as full CPU tensors on rank 0 (empty elsewhere). Collective under FSDP2, and under
        pipeline stages (gathered from every stage, parallel/pipeline.py)."""
        from elastictrain.parallel.pipeline import StageSet, gather_full_state

        if isinstance(self.model, StageSet):
            import torch.distributed as dist

            return gather_full_state(self.model, dist.get_rank())
        api = _state_dict_api()
        return api.get_model_state_dict(self.model, options=api.StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
