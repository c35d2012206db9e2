"""Checkpoint benchmark (a script, not a test): training stall and write throughput.

    PYTHONPATH=. python benchmarks/checkpoint.py [--mb 400] [--repeats 3] [--no-s3]

State: a stack of Linear layers plus Adam state (~--mb MB in all), one process (no process group).
Stall: time until ``CheckpointWriter.save_async`` returns (steady state: staging buffers reused) vs a
synchronous ``torch.save`` of the same state to the same directory vs the staging floor (a plain copy of
the same bytes into preallocated host memory). Throughput: bytes / background write time of our writer
vs a raw fsspec write of the same number of bytes, to a local dir and to S3 (a moto server; both S3
modes of the writer are measured).
Targets: stall <= 1.5x floor and < 1/10 of sync save; throughput >= 0.8x raw.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import fsspec
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from elastictrain.checkpoint import CheckpointWriter, app_state  # noqa: E402
from elastictrain.config import CheckpointConfig  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def build_state(total_mb: int) -> tuple[dict, int]:
    """Model + Adam (exp_avg, exp_avg_sq): 3x the parameter bytes."""
    width = 2048
    per_layer = width * width * 4 * 3
    layers = max(1, total_mb * 2**20 // per_layer)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    state = app_state(model, opt)  # materialises Adam state
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    return state, nbytes


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def staging_floor(state: dict) -> float:
    srcs = list(_tensors(state))
    dst = [torch.empty_like(t) for t in srcs]
    for d, s in zip(dst, srcs):  # fault the pages in once, as a reused staging buffer would be
        d.copy_(s)
    t0 = time.perf_counter()
    for d, s in zip(dst, srcs):
        d.copy_(s)
    return time.perf_counter() - t0


def sync_save(state: dict, root: str) -> float:
    os.makedirs(root, exist_ok=True)
    t0 = time.perf_counter()
    with open(os.path.join(root, "sync.pt"), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def writer_run(state: dict, root: str, opts: dict, repeats: int, s3_mode: str = "buffer") -> tuple[list, list]:
    """(stall seconds per save, background write seconds per save)."""
    cfg = CheckpointConfig(when_busy="wait", storage_options=opts)
    writer = CheckpointWriter(cfg, root, 0, 1, None, s3_mode=s3_mode)
    stalls, writes = [], []
    try:
        for step in range(repeats + 1):  # save 0 warms the staging buffers (first-touch page faults)
            t0 = time.perf_counter()
            writer.save_async(step, state)
            stall = time.perf_counter() - t0
            (report,) = writer.wait(600)
            if report.error:
                raise RuntimeError(report.error)
            if step:
                stalls.append(stall)
                writes.append(report.write_s)
    finally:
        writer.close()
    return stalls, writes


def raw_write(nbytes: int, url: str, opts: dict) -> float:
    data = os.urandom(1 << 20) * (nbytes >> 20)
    fs, path = fsspec.core.url_to_fs(url, **opts)
    t0 = time.perf_counter()
    if url.startswith("s3://"):
        fs.pipe(path, data)
    else:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def start_s3() -> tuple[object, dict]:
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    opts = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    fsspec.filesystem("s3", **opts).mkdir("bench")
    return server, opts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    state, nbytes = build_state(args.mb)
    mb = nbytes / 2**20
    tmp = tempfile.mkdtemp(prefix="ckpt-bench-")
    try:
        floor = statistics.median(staging_floor(state) for _ in range(args.repeats))
        sync = statistics.median(sync_save(state, tmp) for _ in range(args.repeats))
        stalls, writes = writer_run(state, os.path.join(tmp, "run"), {}, args.repeats)
        raw_local = statistics.median(raw_write(nbytes, os.path.join(tmp, "raw.bin"), {}) for _ in range(args.repeats))
        stall = statistics.median(stalls)
        w_local = statistics.median(writes)
        print(f"state: {mb:.0f} MiB ({nbytes} bytes), torch threads {torch.get_num_threads()}")
        print(f"{'measure':<44}{'seconds':>10}{'MiB/s':>10}")
        print(f"{'staging floor (copy into preallocated host)':<44}{floor:>10.3f}{mb / floor:>10.0f}")
        print(f"{'save_async stall (steady state, median)':<44}{stall:>10.3f}{mb / stall:>10.0f}")
        print(f"{'synchronous torch.save + fsync':<44}{sync:>10.3f}{mb / sync:>10.0f}")
        print(f"{'writer background write, local':<44}{w_local:>10.3f}{mb / w_local:>10.0f}")
        print(f"{'raw write + fsync, local':<44}{raw_local:>10.3f}{mb / raw_local:>10.0f}")
        rows = [
            ("stall / staging floor (target <= 1.5)", stall / floor),
            ("stall / sync save (target < 0.1)", stall / sync),
            ("local throughput / raw (target >= 0.8)", raw_local / w_local),
        ]
        if not args.no_s3:
            server, opts = start_s3()
            try:
                raw_s3 = statistics.median(raw_write(nbytes, f"s3://bench/raw-{i}", opts) for i in range(args.repeats))
                for mode in ("buffer", "stream"):
                    _, w = writer_run(state, f"s3://bench/run-{mode}", opts, args.repeats, s3_mode=mode)
                    ws3 = statistics.median(w)
                    print(f"{f'writer background write, S3 ({mode})':<44}{ws3:>10.3f}{mb / ws3:>10.0f}")
                    rows.append((f"S3 {mode} throughput / raw pipe (target >= 0.8)", raw_s3 / ws3))
                print(f"{'raw fs.pipe, S3 (moto)':<44}{raw_s3:>10.3f}{mb / raw_s3:>10.0f}")
            finally:
                server.stop()
        print()
        for name, value in rows:
            print(f"{name:<52}{value:>8.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
