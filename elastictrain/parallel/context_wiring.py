"""Context parallelism (``parallel.cp``) in the step loop: one small function per concern.

The math (the head-tail split, the attention, the loss and gradient rules) is
:mod:`elastictrain.parallel.context`; this module is where the worker meets it:

* :func:`flatten_dp_cp` (at mesh build, collective): the data-parallel axes and ``cp`` flattened into ONE
  mesh dimension, the group the gradients are averaged over (torchtitan's rule: FSDP shards over
  ``dp_shard x cp``; DDP's group is ``dp_replicate x cp``); :func:`dp_cp_submesh` hands it to the layout
  (:func:`elastictrain.parallel.parallelize.dp_submesh` asks it);
* :func:`wire_model` (after the layout is applied): sets the cp group on the model's hooks
  (:func:`~elastictrain.parallel.context.enable_context_parallel`) and makes only cp coordinate 0 count the
  (loss, stop) word and the sample audit (every cp rank holds the same per-sample losses and samples);
* :func:`shard_batch` (after each micro-batch is loaded, before the loss): this rank's positions of it;
* :func:`check_task` (on the driver, before any Ray resource): a user model without the hook is refused
  with :func:`~elastictrain.parallel.context.context_parallel_refusal`'s line, and under ``parallel.pp > 1``
  pipeline hooks whose loss takes no ``cp_group`` with
  :func:`~elastictrain.parallel.context.pipeline_cp_refusal`'s.

Under pipeline parallelism :func:`wire_model` is not called: ``build_pipeline``
(:mod:`elastictrain.parallel.pipeline`) sets the cp group on each stage module and counts by cp coordinate 0.

The data rank of a cp rank is :meth:`MeshDims.dp_rank` (cp is not a batch axis: the cp ranks of one data
rank read the same samples); the micro-batch scale stays ``sum * W_dp / G`` with ``W_dp`` the data ranks
(the cp rule's factor ``cp`` is inside :func:`~elastictrain.parallel.context.cp_sample_loss`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from elastictrain.parallel.dims import MeshDims

# The flattened dimension's name per plan: the data-parallel axis cp joins (hsdp: the shard axis).
_FLAT = {"ddp": ("dp_replicate", "dp_cp"), "fsdp": ("dp_shard", "dp_shard_cp"), "hsdp": ("dp_shard", "dp_shard_cp")}


def flatten_dp_cp(mesh: DeviceMesh, dims: MeshDims) -> None:
    """Register the ``(data axis, cp)`` flattened dimension on ``mesh`` (its process group is created here:
    collective, every rank calls it once right after the mesh is built). Nothing without cp."""
    if dims.cp == 1:
        return
    axis, flat = _FLAT[dims.plan]
    mesh[(axis, "cp")]._flatten(flat)


def dp_cp_submesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh the gradients are averaged (and FSDP shards) over under cp: ``dp_cp`` (ddp), ``dp_shard_cp``
    (fsdp) or ``dp_replicate x dp_shard_cp`` (hsdp); None when ``mesh`` has no ``cp`` axis. ``mesh`` may be
    a pipeline stage's submesh (every axis but ``pp``): the flattened dimension is registered on the root
    mesh, so it is sliced from there (this rank's group, the same ranks)."""
    names = tuple(mesh.mesh_dim_names or ())
    if "cp" not in names:
        return None
    if "dp_shard" in names:
        want = ("dp_replicate", "dp_shard_cp") if "dp_replicate" in names else ("dp_shard_cp",)
    else:
        want = ("dp_cp",)
    root = mesh._get_root_mesh()  # (torch 2.13: a flattened dim is not a name of a submesh sliced before it)
    with warnings.catch_warnings():  # torch 2.13 warns that slicing a flattened dim from the root will go
        warnings.simplefilter("ignore", UserWarning)
        return root[want]


def cp_coord(dims: MeshDims, rank: int) -> int:
    """``rank``'s coordinate on the ``cp`` axis (which positions of each sample it holds)."""
    return dims.coord(rank)["cp"]


def wire_model(pm: Any, mesh: DeviceMesh, dims: MeshDims, rank: int) -> None:
    """Turn context parallelism on (or off) for ``pm`` (a :class:`~elastictrain.parallel.parallelize.ParallelModel`)
    after the layout is applied: the cp axis group on the model's hooks, and the (loss, stop) word and the
    audit counted by cp coordinate 0 only. ``cp == 1``: a hooked model's group is cleared (a model kept
    across a re-mesh may carry an earlier generation's); one that has none is left untouched (writing the
    attribute would fail the guards of its compiled blocks: a recompile). Raises ``ValueError`` with the refusal line for a
    model without the hook under cp > 1."""
    from elastictrain.parallel.context import _hooked, enable_context_parallel

    if dims.cp == 1:
        for module in _hooked(pm.model):
            if module.cp_group is not None:  # set only when set: a compiled block guards on its __dict__
                module.cp_group = None
        return
    enable_context_parallel(pm.model, mesh["cp"].get_group())
    first = cp_coord(dims, rank) == 0
    pm.counts_loss = pm.counts_loss and first
    pm.feeds_samples = pm.feeds_samples and first


def shard_batch(batch: dict[str, torch.Tensor], dims: MeshDims | None, rank: int) -> dict[str, torch.Tensor]:
    """This rank's part of a loaded micro-batch (:func:`~elastictrain.parallel.context.shard_sequence` on
    dim 1, with ``positions``); the batch itself without cp."""
    if dims is None or dims.cp == 1:
        return batch
    from elastictrain.parallel.context import shard_sequence

    return shard_sequence(batch, dims.cp, cp_coord(dims, rank))


def check_task(config: Any, task: Any) -> None:
    """Under ``parallel.cp > 1``, a ConfigError with :func:`~elastictrain.parallel.context.context_parallel_refusal`'s
    line when the task's model lacks the hook (built on the meta device: no memory, no values), or under
    ``parallel.pp > 1`` :func:`~elastictrain.parallel.context.pipeline_cp_refusal`'s when its pipeline loss
    takes no ``cp_group``."""
    if config.parallel.cp == 1:
        return
    from elastictrain.config import ConfigError
    from elastictrain.parallel.context import context_parallel_refusal
    from elastictrain.parallel.materialize import params_on_meta

    with params_on_meta():
        model: nn.Module = task.model_fn()
    why = context_parallel_refusal(model)
    if not why and config.parallel.pp > 1 and task.pipeline is not None:  # (no hooks: build_pipeline says so)
        from elastictrain.parallel.context import pipeline_cp_refusal

        why = pipeline_cp_refusal(task.pipeline)
    if why:
        raise ConfigError(why)
