"""ddp vs fsdp vs hsdp on 4 CPU processes: throughput and peak memory per process, in one run.

Run: ``python benchmarks/parallel.py [--world 4] [--steps 5] [--warmup 2] [--d-model 512] [--layers 8]``

Each plan runs the framework's own step loop (``StepRunner``: the real ``parallelize_fn``, accumulation,
clipping, AdamW) in ``--world`` spawned processes over gloo, on the built-in GPT (default ~25.4M
parameters, so the training state -- 4 bytes x (params + grads + 2 Adam moments) ~ 400 MB -- dominates
the torch runtime's own memory). Same global batch, micro batch, data and seed for every plan.

Figures per plan:
* samples/s: ``(steps - warmup) * global_batch / elapsed`` on rank 0 (steady state);
* peak RSS per process (max over ranks of ``ru_maxrss``) and the same minus the process's RSS before the
  model was built (the runtime baseline), so the ratio to ddp can be read for the state alone too;
* snapshot stall and time to next step after a kill: HOOK, not measured here -- they need the in-memory
  shard tier (another work item); the columns print ``n/a`` until it exists.

Memory note: glibc keeps freed heap memory and raises its mmap threshold as large blocks come and go, so
FSDP2's per-block transient buffers (gathered parameters, unsharded gradients) inflate ``ru_maxrss`` far
above what is live (measured: fsdp 1.07x ddp without the setting below, 0.61x with it). The benchmark sets
``MALLOC_MMAP_THRESHOLD_=131072`` (unless set) for its processes, for every plan alike, so blocks over
128 KiB are mmapped and returned at once and the peak reflects live memory.

Machine note: on a shared 2-core machine four processes contend for CPU; compare plans within one run only.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, plan: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from elastictrain import build_config
    from elastictrain.parallel.plan import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    cfg = build_config({
        "task": {"model": {"seq_len": 64, "n_layer": args.layers, "n_head": 8, "d_model": args.d_model,
                           "dropout": 0.0}},
        "train": {"steps": args.steps, "global_batch": args.global_batch, "micro_batch": args.micro_batch},
        "workers": {"min": world, "max": world}, "parallel": {"plan": plan, "shard_size": 2},
    })
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    task = builtin_task(cfg)
    baseline = _rss_kb()
    runner = StepRunner(task, cfg.train, FaultInjector([]), parallel=cfg.parallel)
    runner.attach(rank, world, 0, resolve(spec_from_config(cfg), world))
    params = sum(p.numel() for p in runner.model.parameters())
    t0 = 0.0
    for s in range(args.steps):
        if s == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        runner.run_step(False)
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(os.path.join(out, f"{plan}.{rank}"), "w") as f:
        f.write(f"{elapsed} {peak} {baseline} {params}\n")
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--plans", default="ddp,fsdp,hsdp")
    args = p.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the spawned ranks (see doc)
    out = tempfile.mkdtemp(prefix="parallel-bench-")
    rows = {}
    for plan in args.plans.split(","):
        mp.start_processes(_worker, args=(args.world, _free_port(), args, plan, out), nprocs=args.world,
                           start_method="spawn")
        ranks = [open(os.path.join(out, f"{plan}.{r}")).read().split() for r in range(args.world)]
        elapsed = float(ranks[0][0])
        peak = max(int(r[1]) for r in ranks) / 1024
        state = max(int(r[1]) - int(r[2]) for r in ranks) / 1024
        rows[plan] = ((args.steps - args.warmup) * args.global_batch / elapsed, peak, state, int(ranks[0][3]))
    print(f"world={args.world} params={rows[next(iter(rows))][3] / 1e6:.1f}M global_batch={args.global_batch} "
          f"micro_batch={args.micro_batch} steps={args.steps} (warmup {args.warmup}) "
          f"load1={os.getloadavg()[0]:.1f}")
    base = rows.get("ddp")
    print(f"{'plan':6} {'samples/s':>10} {'peak MiB':>9} {'x ddp':>6} {'peak-base MiB':>14} {'x ddp':>6} "
          f"{'snap stall':>10} {'next step after kill':>21}")
    for plan, (sps, peak, state, _) in rows.items():
        rp = f"{peak / base[1]:.2f}" if base else "-"
        rs = f"{state / base[2]:.2f}" if base else "-"
        print(f"{plan:6} {sps:10.2f} {peak:9.0f} {rp:>6} {state:14.0f} {rs:>6} {'n/a':>10} {'n/a':>21}")


if __name__ == "__main__":
    main()
