"""A cheap dataset fingerprint: its length plus a hash of a few sampled items.

Every worker computes it in its set-up; the controller refuses a worker whose fingerprint differs from the
group's (e.g. a Parquet prefix that grew between two workers' set-ups, which would give each rank its own
permutation), and a resume refuses a checkpoint written over other data. Items are sampled at fixed
positions (first, last and evenly spaced), so the cost does not grow with the dataset. A prepared corpus
(:class:`~elastictrain.data.windows.PreparedWindows`) is fingerprinted by its manifest: its shards' SHA-256 and
its tokenizer's, so a checkpoint over another corpus or tokenizer is refused with both named.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

_SAMPLES = 16


def sample_positions(n: int, count: int = _SAMPLES) -> list[int]:
    """Up to ``count`` distinct positions in ``[0, n)``: first, last and evenly spaced between."""
    if n <= 0:
        return []
    if n <= count:
        return list(range(n))
    return sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})


def _update(h: Any, leaf: Any) -> None:
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(repr(leaf).encode())


def dataset_fingerprint(dataset: Any, count: int = _SAMPLES) -> dict[str, Any]:
    """``{"len": n, "sha256": hash of the sampled items}`` of a map-style dataset; a dataset with its own
    ``fingerprint()`` (a prepared corpus: from its manifest, no data read) gives that instead."""
    own = getattr(dataset, "fingerprint", None)
    if callable(own):
        return own()
    n = len(dataset)
    h = hashlib.sha256()
    for i in sample_positions(n, count):
        h.update(f"#{i}".encode())
        leaves, spec = tree_flatten(dataset[i])
        h.update(str(spec).encode())
        for leaf in leaves:
            _update(h, leaf)
    return {"len": n, "sha256": h.hexdigest()[:16]}
