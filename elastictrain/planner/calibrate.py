"""``elastictrain plan --calibrate``: measure what the cost model otherwise assumes, in a few seconds.

* ``flops``: a square matmul's rate in this process, at the threads a worker runs with (CPU: fp32,
  ``workers.cpus_per_worker`` threads) or on GPU 0 (bf16);
* ``intra_node_bw`` / ``latency_s``: two processes of this machine all-reduce 16 MiB (gloo on CPU, NCCL
  when the machine has two GPUs) and one element; the bandwidth is the ring's bus bandwidth
  ``2 (n-1)/n * bytes / time`` (what :mod:`.comm` divides by);
* ``inter_node_bw``: the same between two Ray actors on two different nodes, when the Ray cluster this
  process is connected to has several (null otherwise: the planner keeps its default);
* ``runtime_bytes``: on CPU, the resident memory of such a process once torch and its process group are up
  (what a worker holds before the model).

The figures go to a JSON file that ``parallel.calibration: PATH`` names (``elastictrain plan`` and
``parallel.plan: auto`` read it: :func:`.cluster.with_calibration`).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

ALL_REDUCE_BYTES = 16 << 20


def matmul_flops(use_gpu: bool, threads: int = 1, seconds: float = 0.5) -> float:
    """FLOP/s of repeated ``n x n`` matmuls (fp32 on CPU with ``threads`` threads, bf16 on GPU 0)."""
    import torch

    if use_gpu and torch.cuda.is_available():
        n, dtype, device = 4096, torch.bfloat16, torch.device("cuda", 0)
    else:
        torch.set_num_threads(max(1, threads))
        n, dtype, device = 512, torch.float32, torch.device("cpu")
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    (a @ b).sum().item()  # warm-up (and CUDA context)
    iters, t0 = 0, time.perf_counter()
    while True:
        c = a @ b
        iters += 1
        if iters % 4 == 0:
            c.sum().item()  # sync on GPU
            if time.perf_counter() - t0 > seconds:
                break
    return 2 * n ** 3 * iters / (time.perf_counter() - t0)


def _rss_bytes() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    return 0.0


def all_reduce_figures(rank: int, world: int, store_addr: tuple[str, int], use_gpu: bool,
                       threads: int = 1) -> dict[str, float]:
    """In each of ``world`` processes: join a group over a TCP store at ``store_addr`` (rank 0 hosts it),
    time all-reduces, and return bus bandwidth, latency and resident bytes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, threads))
    gpu = use_gpu and torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    store = dist.TCPStore(store_addr[0], store_addr[1], world, is_master=rank == 0, timeout=_timeout())
    dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=rank, world_size=world,
                            timeout=_timeout())
    try:
        big = torch.ones(ALL_REDUCE_BYTES // 4, dtype=torch.float32, device=device)
        tiny = torch.ones(1, device=device)
        for _ in range(2):
            dist.all_reduce(big)
        reps, t0 = 6, time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(big)
        if gpu:
            torch.cuda.synchronize()
        per = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(tiny)
        if gpu:
            torch.cuda.synchronize()
        latency = (time.perf_counter() - t0) / 20 / (2 * (world - 1))
        bw = 2 * (world - 1) / world * ALL_REDUCE_BYTES / per
        return {"bus_bw": bw, "latency_s": latency, "rss_bytes": _rss_bytes()}
    finally:
        dist.destroy_process_group()


def _timeout():  # noqa: ANN202
    from datetime import timedelta

    return timedelta(seconds=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, use_gpu: bool, threads: int, queue: Any) -> None:
    queue.put((rank, all_reduce_figures(rank, world, ("127.0.0.1", port), use_gpu, threads)))


def local_all_reduce(use_gpu: bool, threads: int = 1, world: int = 2) -> dict[str, float]:
    """Rank 0's figures of ``world`` processes of this machine all-reducing (module docstring)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, use_gpu, threads, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results[0]


def cross_node_all_reduce(use_gpu: bool, threads: int = 1) -> float | None:
    """Bus bandwidth between two Ray actors on two different nodes (None without a connected Ray of two
    nodes or more)."""
    import ray

    if not ray.is_initialized():
        return None
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) >= 1]
    if len(nodes) < 2:
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=1)
    class _Peer:
        def address(self) -> tuple[str, int]:
            return ray.util.get_node_ip_address(), _free_port()

        def run(self, rank: int, addr: tuple[str, int]) -> dict[str, float]:
            return all_reduce_figures(rank, 2, addr, False, threads)

    peers = [_Peer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
             for n in nodes[:2]]
    try:
        addr = ray.get(peers[0].address.remote(), timeout=120)
        figures = ray.get([p.run.remote(r, addr) for r, p in enumerate(peers)], timeout=300)
        return figures[0]["bus_bw"]
    finally:
        for p in peers:
            ray.kill(p)


def calibrate(use_gpu: bool, nodes: int = 1, threads: int = 1) -> dict[str, Any]:
    """Every figure of the module docstring, with where and when it was measured."""
    import torch

    local = local_all_reduce(use_gpu, threads)
    figures: dict[str, Any] = {
        "flops": matmul_flops(use_gpu, threads),
        "intra_node_bw": local["bus_bw"],
        "inter_node_bw": cross_node_all_reduce(use_gpu, threads) if nodes > 1 else None,
        "latency_s": local["latency_s"],
        "runtime_bytes": None if use_gpu else local["rss_bytes"],
        "kind": "gpu" if use_gpu else "cpu",
        "threads": threads,
        "host": platform.node(),
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load": os.getloadavg()[0],
    }
    return figures


def write(figures: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(figures, indent=1) + "\n")
    return p
