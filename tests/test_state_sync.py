"""Chunked state broadcast (bounded extra memory) between real gloo processes."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from elastictrain.worker.state_sync import _buckets, broadcast_state
from tests.ranks import run_ranks


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(9, 33), torch.nn.LayerNorm(33), torch.nn.Linear(33, 2))
    m.register_buffer("counter", torch.arange(5))  # an int64 tensor: another dtype run
    return m


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = _model(seed=rank)  # different parameters on each rank
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
        if rank == 1:  # the source has trained: non-empty optimizer state
            for _ in range(2):
                model(torch.randn(4, 9)).sum().backward()
                opt.step()
                opt.zero_grad()
        step = broadcast_state(model, opt, 7 if rank == 1 else 0, src=1, chunk_bytes=256)
        torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, Path(out, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_broadcast_is_exact_with_tiny_chunks(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_ranks(_worker, (port, str(tmp_path)), 2)
    a, b = (torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in (0, 1))
    assert a["step"] == b["step"] == 7
    from torch.utils._pytree import tree_flatten

    la, sa = tree_flatten({"m": a["model"], "o": a["optim"]})
    lb, sb = tree_flatten({"m": b["model"], "o": b["optim"]})
    assert sa == sb and len(la) == len(lb)
    for x, y in zip(la, lb):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert a["optim"]["param_groups"][0]["betas"] == (0.8, 0.9)


def test_buckets_bound_extra_memory() -> None:
    ts = [torch.zeros(n, dtype=d) for n, d in [(3, torch.float32), (10, torch.float32), (200, torch.float32),
                                               (2, torch.int64), (1, torch.float32), (5, torch.float32)]]
    runs = list(_buckets(ts, chunk_bytes=128))
    assert [len(r) for r in runs] == [1, 1, 1, 1, 2]  # 40 bytes >= 128/4: in place; dtype changes split
    assert sum(len(r) for r in runs) == len(ts) and [t for r in runs for t in r] == ts  # order kept
    for r in runs:
        assert len(r) == 1 or (sum(t.numel() * t.element_size() for t in r) <= 128 and len({t.dtype for t in r}) == 1)
