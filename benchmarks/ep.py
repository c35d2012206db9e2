"""Expert parallel's memory per rank: ep2 against ep1 on the same 2 processes, and the planner against it.

Run: ``python benchmarks/ep.py [--layers 4] [--d-model 512] [--experts 8] [--top-k 2] [--steps 4] [--warmup 2]
[--global-batch 8] [--micro-batch 2] [--seq-len 64]``

Two CPU processes over gloo run the framework's own step loop (``StepRunner``: attach with the real
``parallelize_fn`` and :mod:`elastictrain.parallel.expert_wiring`, DDP, the expert gradients' reduction,
clipping, AdamW) on the built-in GPT with every MLP a mixture of ``--experts`` experts (``--top-k`` per
token), once with ``parallel.ep: 1`` (ddp 2: every rank holds every expert) and once with ``parallel.ep: 2``
(ddp 2 factored as one ep group: each rank holds half the experts). The defaults give a 72M-parameter model,
93% of it experts. Per layout: the training peak of resident memory (``VmHWM`` reset after the warm-up, max
over ranks, the issue's "peak memory per rank"), the same less the rank's resident memory before the model
was built (the runtime, which no layout shards), and the planner's prediction for the same candidate
(:func:`elastictrain.planner.memory`: weights, gradients, AdamW state and activations of the rank; no
runtime or fragmentation, which the measured figure leaves out too). Printed: ep2 / ep1 for both measures
(target <= 0.6x at >= 50M parameters, issue 39) and predicted / measured for each layout (target within 10%).

``MALLOC_MMAP_THRESHOLD_=131072`` is set for the processes (as in benchmarks/parallel.py): blocks over 128 KiB
are mmapped and returned when freed, so the peak reflects live memory (the whole experts a rank drops when
it keeps its slice are returned). Figures: ``docs/perf/2026-11-28-ep.md``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")

WORLD = 2


def _spec(args: argparse.Namespace, ep: int) -> dict:
    return {"task": {"model": {"seq_len": args.seq_len, "n_layer": args.layers, "n_head": 8,
                               "d_model": args.d_model, "dropout": 0.0,
                               "moe": {"experts": args.experts, "top_k": args.top_k}}},
            "train": {"steps": args.steps, "global_batch": args.global_batch, "micro_batch": args.micro_batch},
            "workers": {"min": WORLD, "max": WORLD}, "parallel": {"plan": "ddp", "ep": ep}}


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _peak_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _worker(rank: int, port: int, args: argparse.Namespace, ep: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from elastictrain import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    cfg = build_config(_spec(args, ep))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    task = builtin_task(cfg)
    baseline = _rss_kb()
    runner = StepRunner(task, cfg.train, FaultInjector([]), parallel=cfg.parallel)
    runner.attach(rank, WORLD, 0, resolve(spec_from_config(cfg), WORLD))
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in runner.model.parameters())
    for s in range(args.steps):
        if s == args.warmup:
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:  # the training peak starts here
                f.write("5")
        runner.run_step(False)
    with open(os.path.join(out, f"ep{ep}.{rank}"), "w") as f:
        f.write(f"{_peak_kb()} {baseline} {held}\n")
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(args: argparse.Namespace, ep: int, out: str) -> tuple[float, float, int]:
    """(training peak MiB, peak less the pre-model runtime MiB, parameters held) of ``ep``, max over ranks."""
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(_free_port(), args, ep, out), nprocs=WORLD, start_method="spawn")
    ranks = [[int(v) for v in open(os.path.join(out, f"ep{ep}.{r}")).read().split()] for r in range(WORLD)]
    return (max(r[0] for r in ranks) / 1024, max(r[0] - r[1] for r in ranks) / 1024, max(r[2] for r in ranks))


def _predicted(args: argparse.Namespace, ep: int) -> tuple[float, float]:
    """(planner MiB of the rank's model bytes and activations, the model's parameters)."""
    from elastictrain import build_config
    from elastictrain.planner import Candidate, Cluster, Training, memory
    from elastictrain.planner.job import model_shape

    cfg = build_config(_spec(args, ep))
    model = model_shape(cfg)
    train = Training(args.global_batch, args.micro_batch, precision="fp32", optimizer="adam", activation_bytes=4)
    cluster = Cluster(nodes=1, devices_per_node=WORLD, device_memory=64 * 2 ** 30, flops=1e11, intra_node_bw=1e9,
                      inter_node_bw=1e9, kind="cpu", runtime_bytes=0.0, fragmentation=0.0)
    mem = memory(model, train, cluster, Candidate(dp_replicate=WORLD, ep=ep, micro_batch=args.micro_batch))
    return mem.total / 2 ** 20, model.total_params


def main() -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    args = p.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        for ep in (1, 2):
            rows[ep] = (*_measure(args, ep, out), *_predicted(args, ep))
    params = rows[1][4]
    print(f"GPT {args.layers} x d_model {args.d_model}, {args.experts} experts top-{args.top_k}: {params / 1e6:.1f}M "
          f"parameters; {WORLD} processes, global batch {args.global_batch}, micro batch {args.micro_batch}, "
          f"seq {args.seq_len}")
    print(f"{'layout':8} {'held params':>12} {'train peak MiB':>15} {'peak-runtime MiB':>17} {'planner MiB':>12} "
          f"{'planner/measured':>17}")
    for ep, (peak, state, held, pred, _) in rows.items():
        print(f"{'ep' + str(ep):8} {held / 1e6:11.1f}M {peak:15.0f} {state:17.0f} {pred:12.0f} {pred / state:17.3f}")
    (p1, s1, *_), (p2, s2, *_) = rows[1], rows[2]
    big = params >= 50e6
    verdict = (lambda ok: "MET" if ok else "NOT MET") if big else (lambda ok: "(model < 50M: no verdict)")
    print(f"ep2 / ep1: train peak {p2 / p1:.3f}, peak-runtime {s2 / s1:.3f} (target <= 0.6) {verdict(p2 / p1 <= 0.6)}")
    worst = max(abs(r[3] / r[1] - 1) for r in rows.values())
    print(f"planner vs measured (peak-runtime): worst {100 * worst:.1f}% off (target within 10%) "
          f"{'MET' if worst <= 0.10 else 'NOT MET'}")


if __name__ == "__main__":
    main()
