"""A fingerprint of the whole model that every rank computes from its own part, whatever the layout.

Each rank hashes only the elements it holds: every element's hash is a function of (parameter name, the
element's index in the full tensor, its bits), and a parameter's hash is the SUM (mod 2^64) of its
elements' hashes -- order-free, so any partition of a tensor (fsdp rows, tp columns, strided 2-D shards,
pipeline stages) sums to the same value. A replicated copy (ddp replicas, hsdp's replicate axis, a tp
rank's replicated norm) is counted once: only the copy at coordinate 0 of every replicated axis counts.
The driver adds the ranks' per-parameter sums (:func:`combine`), checks that every element was counted
exactly once, and hashes the sums in name order with SHA-256. The final model therefore never has to be
gathered on one rank to be compared across runs; two models with equal values under equal names have
equal digests under any layout.

It detects accidental differences (tests compare runs by it), not tampering.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from elastictrain.models.gpt import _mix

_MASK64 = (1 << 64) - 1
_ROWS_PER_CHUNK_ELEMS = 1 << 20  # elements hashed at once: bounds the int64 temporaries (8 MiB each)
# odd 63-bit multipliers (splitmix / PCG constants): int64 arithmetic wraps, so the mix is exact everywhere
_K1, _K2, _K3, _K4 = 0x5851F42D4C957F2D, 0x14057B7EF767814F, 0x2545F4914F6CDD1D, 0x3C6EF372FE94F82B
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def global_indices(t: DTensor) -> list[torch.Tensor]:
    """Per tensor dimension, the global indices this rank's local shard of ``t`` holds along it (every
    Shard / _StridedShard placement applied in mesh order, torch's own rule,
    ``torch.distributed.tensor._utils``). A rank outside ``t``'s mesh holds nothing."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    shape = list(t.shape)
    coord = t.device_mesh.get_coordinate()
    index: dict[int, torch.Tensor] = {}
    from torch.distributed.tensor.placement_types import _StridedShard

    for mesh_dim, p in enumerate(t.placements):
        if not isinstance(p, (Shard, _StridedShard)):  # (torch 2.13: a _StridedShard is not is_shard(): FSDP
            continue                                    # over a tp-sharded dim places one)
        size, offsets = _get_shard_size_and_offsets(shape[p.dim], t.device_mesh.size(mesh_dim), coord[mesh_dim], p,
                                                    index.get(p.dim), t.shape[p.dim], False)
        shape[p.dim] = size
        index[p.dim] = offsets[:size] if size else offsets[:0]
    return [index.get(d, torch.arange(t.shape[d])) for d in range(t.dim())]


def counts(t: torch.Tensor, plain_primary: bool, primary_along: dict[str, bool] | None = None) -> bool:
    """Whether this rank's copy of ``t`` is the one counted: a DTensor's at coordinate 0 of every
    replicated axis of its own mesh and, for the layout's axes its mesh does not span
    (``primary_along``: ``{"dp": ..., "tp": ..., "cp": ...}``, whether this rank is at coordinate 0 along
    them; a tensor-parallel DTensor under ddp lives on the tp axis alone and is replicated over dp; under
    expert parallel ``"edp"``: whether this rank is in the first ep group, where an expert DTensor on the
    ``ep`` axis alone is counted; one FSDP-sharded over ``(edp, ep)`` spans both), at
    coordinate 0 there too; a plain tensor's where ``plain_primary`` (the caller's replica 0)."""
    if isinstance(t, DTensor):
        coord = t.device_mesh.get_coordinate()
        if coord is None or any(c != 0 for c, p in zip(coord, t.placements) if isinstance(p, Replicate)):
            return False
        names = t.device_mesh.mesh_dim_names or ()
        dp = any(n.startswith("dp") for n in names)
        # an expert DTensor lives on the ep axis, a factor of the data x cp x tp ranks: replicated over
        # "edp" only (the first ep group counts it, whichever cp and tp ranks it spans), unless FSDP shards it
        # there too (ep x fsdp: its mesh is (edp, ep); ep x hsdp: (dp_replicate, efsdp, ep)); a flattened
        # dimension spans its parts: "dp_shard_cp" is a data-parallel and a cp dimension
        ep = "ep" in names
        spans = {"dp": dp or ep, "tp": "tp" in names or ep, "edp": dp or "edp" in names or "efsdp" in names,
                 "cp": ep or any("cp" in n.split("_") for n in names)}
        return all(spans[axis] or first for axis, first in (primary_along or {}).items())
    return plain_primary


def local_part(state: dict[str, torch.Tensor], plain_primary: bool,
               primary_along: dict[str, bool] | None = None) -> dict[str, list[Any]]:
    """This rank's contribution: name -> [sum of its counted elements' hashes, elements counted, global
    shape, dtype]. No collective. ``state``: the model state dict as the rank holds it (DTensor shards,
    stage subsets, or whole tensors); ``primary_along``: see :func:`counts`. Raises ValueError naming the
    tensor and its placements when :func:`global_indices` does not map its local shard's shape."""
    out: dict[str, list[Any]] = {}
    for name, t in state.items():
        shape, dtype = list(t.shape), str(t.dtype).removeprefix("torch.")
        if not counts(t, plain_primary, primary_along):
            out[name] = [0, 0, shape, dtype]
            continue
        if isinstance(t, DTensor):
            local, index = t.to_local(), global_indices(t)
            mapped = tuple(len(i) for i in index)
            if mapped != tuple(local.shape):  # a placement global_indices does not map: say which, not a broadcast
                raise ValueError(f"model digest: {name}'s local shard is {tuple(local.shape)} but its placements "
                                 f"{tuple(t.placements)} on mesh {t.device_mesh.mesh_dim_names} map {mapped} of "
                                 f"{tuple(t.shape)}: a placement parallel/digest.py global_indices does not know")
        else:
            local, index = t, [torch.arange(n) for n in t.shape]
        out[name] = [_hash_sum(name, local.detach().cpu(), index, tuple(t.shape)), local.numel(), shape, dtype]
    return out


def combine(parts: list[dict[str, list[Any]]]) -> str:
    """The digest of the whole model from every rank's :func:`local_part`. Raises ValueError naming a
    parameter whose elements were not all counted exactly once (a layout this module does not know)."""
    total: dict[str, list[Any]] = {}
    for part in parts:
        for name, (h, n, shape, dtype) in part.items():
            acc = total.setdefault(name, [0, 0, shape, dtype])
            acc[0] = (acc[0] + h) & _MASK64
            acc[1] += n
    h = hashlib.sha256()
    for name in sorted(total):
        s, n, shape, dtype = total[name]
        numel = 1
        for d in shape:
            numel *= d
        if n != numel:
            raise ValueError(f"model digest: {name} has {numel} elements but the ranks counted {n}")
        h.update(f"{name}|{shape}|{dtype}|{s:016x}\n".encode())
    return h.hexdigest()


def digest_of(state: dict[str, torch.Tensor]) -> str:
    """The digest of a whole model held in one process (what :func:`combine` gives for any layout)."""
    return combine([local_part(state, plain_primary=True)])


def _hash_sum(name: str, local: torch.Tensor, index: list[torch.Tensor], shape: tuple[int, ...]) -> int:
    if local.numel() == 0:
        return 0
    seed = _mix(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))
    if local.dim() == 0:
        local, index, shape = local.reshape(1), [torch.zeros(1, dtype=torch.long)], (1,)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # flat global index of every local element but along dim 0: small (one row of the shard)
    rest = torch.zeros((), dtype=torch.long)
    for d in range(1, len(shape)):
        rest = rest.unsqueeze(-1) + index[d].reshape(-1).long() * strides[d]
    rest = rest.reshape(-1)
    bits = local.contiguous().view(_BITS[local.element_size()]) if local.dtype != torch.bool else local.to(torch.int8)
    bits = bits.reshape(local.shape[0], -1)
    rows = max(1, _ROWS_PER_CHUNK_ELEMS // max(1, bits.shape[1]))
    acc = torch.zeros((), dtype=torch.long)
    for r0 in range(0, bits.shape[0], rows):
        flat = index[0][r0:r0 + rows].long().unsqueeze(1) * strides[0] + rest.unsqueeze(0)
        x = bits[r0:r0 + rows].long() * _K1 + flat * _K2 + seed
        x = (x ^ (x >> 31)) * _K3
        x = (x ^ (x >> 29)) * _K4
        acc += (x ^ (x >> 32)).sum()
    return int(acc) & _MASK64
