"""Bring replicated state (DDP: model, optimizer, step) from one live rank to all others, in memory.

Joiners receive their state from a live peer, never from storage. Tensors travel with ``dist.broadcast``
in one flat buffer per dtype; only the small structure (shapes, optimizer hyper-parameters) is pickled.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _skeleton(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace tensors in a nested structure by placeholders, collecting them in order."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("__tensor__", tuple(obj.shape), str(obj.dtype).removeprefix("torch."))
    if isinstance(obj, dict):
        return {k: _skeleton(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v, tensors) for v in obj)
    return obj


def _fill(skel: Any, it: Any) -> Any:
    if isinstance(skel, tuple) and len(skel) == 3 and skel[0] == "__tensor__":
        return next(it)
    if isinstance(skel, dict):
        return {k: _fill(v, it) for k, v in skel.items()}
    if isinstance(skel, (list, tuple)):
        return type(skel)(_fill(v, it) for v in skel)
    return skel


def _placeholders(skel: Any, out: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
    if isinstance(skel, tuple) and len(skel) == 3 and skel[0] == "__tensor__":
        out.append((skel[1], getattr(torch, skel[2])))
    elif isinstance(skel, dict):
        for v in skel.values():
            _placeholders(v, out)
    elif isinstance(skel, (list, tuple)):
        for v in skel:
            _placeholders(v, out)


def _broadcast_flat(tensors: list[torch.Tensor], src: int, group: Any) -> None:
    """Broadcast a list of tensors in place, one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        group_tensors = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group_tensors]) if group_tensors else None
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        with torch.no_grad():
            for t in group_tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n


def broadcast_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, *, src: int, group: Any = None
) -> int:
    """Make every rank's model, optimizer and step equal to rank ``src``'s. Collective. Returns the step."""
    rank = dist.get_rank(group)
    model_tensors = list(model.state_dict().values())
    header: list[Any] = [None]
    opt_tensors: list[torch.Tensor] = []
    if rank == src:
        header[0] = {"step": step, "optim": _skeleton(optimizer.state_dict(), opt_tensors),
                     "n_model": len(model_tensors)}
    dist.broadcast_object_list(header, src=src, group=group)
    meta = header[0]
    if meta["n_model"] != len(model_tensors):
        raise RuntimeError(
            f"model structure differs between ranks ({meta['n_model']} vs {len(model_tensors)} tensors): "
            "every worker must build the same model"
        )
    if rank != src:
        shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
        _placeholders(meta["optim"], shapes)
        opt_tensors = [torch.empty(s, dtype=d) for s, d in shapes]
    _broadcast_flat(model_tensors + opt_tensors, src, group)
    if rank != src:
        optimizer.load_state_dict(_fill(meta["optim"], iter(opt_tensors)))
    return int(meta["step"])
