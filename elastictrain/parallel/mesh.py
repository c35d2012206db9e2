"""The per-generation device and DeviceMesh: built over the current default process group after every
rendezvous, so each membership generation has its own mesh."""

from __future__ import annotations

import os

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastictrain.parallel.plan import MeshDims


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
    order relative to other group creations)."""
    return init_device_mesh(device.type, dims.shape, mesh_dim_names=dims.names)
