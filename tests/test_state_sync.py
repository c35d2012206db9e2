"""Chunked state broadcast (bounded extra memory) between real gloo processes."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
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


def _device_worker(rank: int, port: int, out: str) -> None:
    """Rank 1 holds state on a non-CPU device (``meta`` stands in for CUDA: no machine here has two GPUs)
    and Adam's layout: moments with the parameters, ``step`` on the CPU. Every tensor broadcast is recorded
    with its device instead of sent (meta tensors hold no bytes); the header travels for real over gloo."""
    import json

    import torch.distributed as dist

    from elastictrain.worker import state_sync

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sent: list[str] = []
    dist.broadcast = lambda t, src, group=None: sent.append(t.device.type)  # type: ignore[assignment]
    try:
        model = _model(seed=0).to("meta")
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        if rank == 1:
            for p in model.parameters():
                opt.state[p] = {"step": torch.tensor(2.0), "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}
        big = 1 << 30  # any tensor is a bucket run: the packing buffer's device is tested too
        state_sync.broadcast_state(model, opt, 7 if rank == 1 else 0, src=1, chunk_bytes=big)
        state_sync.broadcast_state(model, opt, 7 if rank == 1 else 0, src=1, chunk_bytes=64)  # in place
        devices = {k: v.device.type for st in opt.state.values() for k, v in st.items()}
        Path(out, f"d{rank}.json").write_text(json.dumps({"sent": sent, "state": devices}))
    finally:
        dist.destroy_process_group()


def test_receivers_allocate_every_tensor_on_the_sources_device_type(tmp_path: Path) -> None:
    """DDP state sync on GPUs: a receiver must allocate each optimizer tensor on its own device of the
    source's type, and pack buckets on the tensors' device, so that every broadcast pairs one backend on
    all ranks (a CPU receiver of a CUDA source paired gloo with NCCL for tensors >= 4 MiB). Checked with
    the ``meta`` device standing in for CUDA; never run on two GPUs (issue #21 item 12)."""
    import json

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_ranks(_device_worker, (port, str(tmp_path)), 2)
    src, dst = (json.loads(Path(tmp_path, f"d{r}.json").read_text()) for r in (1, 0))
    assert dst["sent"] == src["sent"], (src["sent"], dst["sent"])  # one device type per broadcast, every rank
    assert "meta" in src["sent"] and "cpu" in src["sent"]  # moments with the parameters, steps on the CPU
    assert dst["state"] == src["state"] == {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}


def test_allocation_follows_the_local_device_of_each_type() -> None:
    from elastictrain.worker.state_sync import _TensorSlot, allocate_leaves, bucket_for, local_devices

    model = _model(seed=0).to("meta")
    devices = local_devices(model)
    assert devices == {"cpu": torch.device("cpu"), "meta": torch.device("meta")}
    got = allocate_leaves([_TensorSlot((2, 3), torch.float32, "meta"), 0.9, _TensorSlot((), torch.float32)],
                          devices)
    assert got[0].device.type == "meta" and got[1] == 0.9 and got[2].device.type == "cpu"
    assert bucket_for([torch.zeros(3, device="meta")], torch.zeros(64), 256).device.type == "meta"
    with pytest.raises(RuntimeError, match="same device type"):
        allocate_leaves([_TensorSlot((1,), torch.float32, "cuda")], devices)
