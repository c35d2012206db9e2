"""The per-generation device and DeviceMesh: built over the current default process group after every
rendezvous, so each membership generation has its own mesh."""

from __future__ import annotations

import os

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastictrain.parallel.layout import MeshDims


def worker_device(use_gpu: bool) -> torch.device:
    """This worker's device. With ``use_gpu`` Ray assigns one GPU and sets ``CUDA_VISIBLE_DEVICES`` to it,
    so it is ``cuda:0`` in this process; raises RuntimeError if Ray gave this worker no visible GPU."""
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise RuntimeError(
            f"workers.use_gpu=true but this worker sees no CUDA device (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, torch {torch.__version__} "
            f"cuda={torch.version.cuda}); install a CUDA build of torch or set workers.use_gpu=false"
        )
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def build_mesh(dims: MeshDims, device: torch.device) -> DeviceMesh:
    """The mesh of ``dims`` over the current default group (collective: every rank calls it, in the same
    order relative to other group creations). Caches that could hand back an earlier generation's mesh are
    cleared first (:func:`forget_earlier_meshes`). Under cp the data axis and cp are also flattened into
    the one group gradients are averaged over (:func:`elastictrain.parallel.context_wiring.flatten_dp_cp`)."""
    from elastictrain.parallel.context_wiring import flatten_dp_cp

    forget_earlier_meshes()
    mesh = init_device_mesh(device.type, dims.shape, mesh_dim_names=dims.names)
    flatten_dp_cp(mesh, dims)
    return mesh


def forget_earlier_meshes() -> None:
    """Drop DTensor's caches that are keyed by a DeviceMesh.

    A DeviceMesh compares equal to any other mesh of the same shape, names and ranks, whichever process
    groups it holds. DTensor caches sharding decisions (and redistribution plans) by input specs that
    include the mesh, and a cached output spec carries the mesh object it was first computed on. After a
    membership change rebuilds an equal-looking mesh (HSDP 2x2 -> 1x2 -> 2x2), a cache hit would hand back
    the earlier generation's mesh, whose process groups were destroyed ("Could not resolve the process
    group registered under the name 5"). Clearing them once per generation costs a few recomputed specs.
    The sharding-propagation caches (Python and C++ fast path) are per thread: this clears the calling
    thread's, so every DTensor op of a worker runs on one thread (``worker.actor.STATE_GROUP``); the
    redistribution caches are process-wide. These are private torch caches (torch 2.13); a cache a later
    torch drops is skipped."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
    except (ImportError, AttributeError):
        pass
    try:
        from torch.distributed.tensor import _redistribute
    except ImportError:
        return
    planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if callable(planners):
        planners()
    transform = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(transform, "cache_clear"):
        transform.cache_clear()
    try:
        from torch.distributed.tensor._collective_utils import MeshTopoInfo

        MeshTopoInfo.build_from_mesh.cache_clear()
    except (ImportError, AttributeError):
        pass
    try:  # keyed by (propagator, op schema): its specs carry the mesh, which keeps the groups alive
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    except (ImportError, AttributeError):
        pass
