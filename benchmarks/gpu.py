"""One GPU: the framework's step loop vs a plain FSDP2 loop (step time, MFU, peak memory), and checkpoint
staging into pinned host memory vs a plain pinned ``copy_``, in one process run.

Run (a machine with one CUDA GPU): ``python benchmarks/gpu.py [--sizes tiny,1b] [--steps 12] [--warmup 4]
[--global-batch 32] [--micro-batch 8]``

World size 1 over ``cpu:gloo,cuda:nccl`` (the backend a ``workers.use_gpu`` worker joins), plan ``fsdp`` with
``parallel.mixed_precision: bf16`` (bf16 parameters and compute, fp32 gradient reduction and fp32 master
parameters and AdamW state). Two models, both the built-in GPT (byte vocabulary, learned positions,
dropout 0):

* ``tiny``: the quickstart job's model (2 layers, d_model 64, seq_len 64): launch-bound, shown for scale;
* ``1b``: 20 layers, d_model 2048, 16 heads, seq_len 1024 (1.01e9 parameters).

Sides, one after the other per size (plain first) in the same process, on the same data, global batch,
micro batch, optimizer (the task's own ``optimizer_fn``: fused AdamW on CUDA; learning rate 3e-3 for
``tiny``, 3e-4 for ``1b``), grad clip and mixed-precision policy:

* elastictrain: ``StepRunner.run_step`` after ``attach`` (the real ``parallelize_fn``, cursor, seeds,
  accumulation, the (loss, stop) word, clipping, LR schedule);
* plain: ``fully_shard`` each block then the root with the same policy, and a hand-written loop
  (micro-batch forward/backward, clip, ``optimizer.step``, ``zero_grad``).

Figures: median step time over the steps after ``--warmup`` (``torch.cuda.synchronize`` around each
step), tokens/s, model-FLOPs utilisation ``(6 * N + 12 * L * d * T) * tokens/s / peak`` with ``N`` the
weights of the linears (embeddings excluded, the output head included; torchtitan's formula, one function:
``elastictrain.flops``) and ``peak`` the GPU's dense bf16 figure (its table: H100/H200 SXM 989 TFLOP/s;
``--peak-tflops`` overrides), and
peak GPU memory (``max_memory_allocated`` minus what was allocated before the side started, reset per
side).

Staging (the last size's training state after its steps, this rank's whole shard: for ``1b`` fp32
parameters and two AdamW moments, ~12 GB): ``StagingPool.stage`` (the durable checkpoint's copy) and ``take_snapshot``
(the peer memory tier's copy) against pinned buffers filled by ``copy_(non_blocking=True)`` and one
synchronize. Each is timed on its second run, its host buffers reused (the steady state of periodic saves;
the first plain copy's time, which allocates and pins, is printed apart). GB/s = bytes / seconds; also the
share of host bytes that are pinned and the GPU memory the copy left allocated (a staged copy must live on
the host only). Copies from the GPU run on a side stream (``elastictrain.checkpoint.host_copy``), so the
step thread's stall is less than the copy: the in-loop figure runs steps with a copy after every step
(``state_dict()`` plus ``take_snapshot`` or ``StagingPool.stage``, as a worker does) against steps
without (mean over a window synchronized at both ends only, so the copy can overlap the next step as it
does in a worker); the difference is what a copy costs the loop, shown also as a share of step time at
one copy per 10 steps.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = {
    "tiny": {"seq_len": 64, "n_layer": 2, "n_head": 2, "d_model": 64},
    "1b": {"seq_len": 1024, "n_layer": 20, "n_head": 16, "d_model": 2048},
}
LR = {"tiny": 3e-3, "1b": 3e-4}  # the quickstart's rate for the tiny model; a stable one for 1B parameters
def peak_flops(name: str, override: float | None) -> tuple[float, str]:
    from elastictrain.flops import peak_flops_of

    if override:
        return override * 1e12, "--peak-tflops"
    peak = peak_flops_of(name)
    if peak is not None:
        return peak, "dense bf16 (elastictrain/flops.py)"
    return 989e12, "assumed H100 dense bf16 (unknown GPU)"


def flops_per_token(model: Any, n_layer: int, d_model: int, seq_len: int) -> float:
    """elastictrain.flops.flops_per_token: 6 x the linears' weights (embeddings excluded) + 12 L d T."""
    from elastictrain.flops import flops_per_token as per_token, matmul_params

    return per_token(matmul_params(model), n_layer, d_model, seq_len)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(size: str, args: argparse.Namespace) -> Any:
    from elastictrain import build_config

    return build_config({
        "task": {"model": {**SIZES[size], "dropout": 0.0}, "optimizer": {"lr": LR[size]}},
        "train": {"steps": 1000, "global_batch": args.global_batch, "micro_batch": args.micro_batch},
        "workers": {"min": 1, "max": 1, "use_gpu": True},
        "parallel": {"plan": "fsdp", "mixed_precision": "bf16"},
        "checkpoint": {"memory_every_steps": 0},
    })


def _timed(step_fn: Any, steps: int, warmup: int) -> list[float]:
    import torch

    times = []
    for s in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_fn()
        torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def run_elastictrain(size: str, args: argparse.Namespace) -> tuple[list[float], int, Any]:
    import torch

    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    cfg = _config(size, args)
    runner = StepRunner(builtin_task(cfg), cfg.train, FaultInjector([]), parallel=cfg.parallel,
                        device=torch.device("cuda", 0))
    runner.attach(0, 1, 0, resolve(spec_from_config(cfg), 1))
    losses: list[float] = []

    def step() -> None:
        record, _ = runner.run_step(False)
        losses.append(record.loss)

    times = _timed(step, args.steps, args.warmup)
    print(f"  elastictrain losses: first {losses[0]:.4f} last {losses[-1]:.4f}", flush=True)
    return times, torch.cuda.max_memory_allocated(), runner


def run_plain(size: str, args: argparse.Namespace) -> tuple[list[float], int, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from elastictrain.models.gpt import per_sample_loss
    from elastictrain.task import builtin_task

    cfg = _config(size, args)
    task = builtin_task(cfg)
    torch.manual_seed(cfg.train.seed)
    model = task.model_fn().cuda()
    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = task.optimizer_fn(model.parameters())
    data = task.dataset_fn()
    g, m = cfg.train.global_batch, cfg.train.micro_batch
    counter = [0]

    def step() -> None:
        base = counter[0] * g
        counter[0] += 1
        for k in range(g // m):
            rows = [data[(base + k * m + i) % len(data)] for i in range(m)]
            x = torch.stack([r["input"] for r in rows]).cuda(non_blocking=True)
            y = torch.stack([r["target"] for r in rows]).cuda(non_blocking=True)
            (per_sample_loss(model(x), y).sum() / g).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), task.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = _timed(step, args.steps, args.warmup)
    return times, torch.cuda.max_memory_allocated(), model


def staging(runner: Any) -> list[tuple[str, float, float, float, int]]:
    """(what, GB/s, pinned share of the host bytes, GPU bytes it left allocated, bytes) for a plain pinned
    ``copy_``, ``StagingPool.stage`` and ``take_snapshot``; each timed on its second run (host buffers
    reused: the steady state of periodic saves)."""
    import torch
    from torch.distributed.tensor import DTensor

    from elastictrain.checkpoint.memory_dcp import take_snapshot
    from elastictrain.checkpoint.staging import StagingPool

    state = runner.state.state_dict()
    sources = []
    for part in (state["model"], state["optim"]["state"]):
        for value in part.values():
            for t in (value.values() if isinstance(value, dict) else [value]):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    sources.append(t.to_local() if isinstance(t, DTensor) else t)

    def host_tensors(obj: Any) -> list[Any]:
        from torch.utils._pytree import tree_leaves

        leaves = [x.to_local() if isinstance(x, DTensor) else x for x in tree_leaves(obj)]
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    def pinned_share(tensors: list[Any]) -> float:
        total = sum(t.numel() * t.element_size() for t in tensors)
        return sum(t.numel() * t.element_size() for t in tensors if t.is_pinned()) / max(1, total)

    def timed(fn: Any) -> tuple[float, int]:
        torch.cuda.synchronize()
        gpu0 = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, torch.cuda.memory_allocated() - gpu0

    rows = []
    bufs: list[torch.Tensor] = []

    def plain_copy() -> None:
        if not bufs:
            bufs.extend(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in sources)
        for b, t in zip(bufs, sources):
            b.copy_(t, non_blocking=True)
        torch.cuda.synchronize()

    first, _ = timed(plain_copy)
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    print(f"  first plain copy (allocates and pins {nbytes / 1e9:.2f} GB): {first:.2f} s", flush=True)
    seconds, gpu = timed(plain_copy)
    rows.append(("plain pinned copy_ (GPU tensors only)", nbytes / seconds / 1e9, pinned_share(bufs), gpu, nbytes))
    del bufs[:]
    pool = StagingPool()
    held: list[Any] = []
    timed(lambda: held.append(pool.stage(state)))
    pool.release(held.pop())
    seconds, gpu = timed(lambda: held.append(pool.stage(state)))
    on_cpu = all(t.device.type == "cpu" for t in host_tensors(held[-1].state))
    rows.append((f"StagingPool.stage (all on host: {on_cpu})", held[-1].nbytes / seconds / 1e9,
                 pinned_share(held[-1].buffers), gpu, held[-1].nbytes))
    held.clear()
    pool.clear()
    snaps: list[Any] = []
    timed(lambda: snaps.append(take_snapshot(state, rank=0, step=1)))
    seconds, gpu = timed(lambda: snaps.append(take_snapshot(state, rank=0, step=2, reuse=snaps[0])))
    host = [t for t in snaps[-1].data.values() if isinstance(t, torch.Tensor)]
    rows.append(("take_snapshot (peer tier)", snaps[-1].meta.nbytes / seconds / 1e9, pinned_share(host), gpu,
                 snaps[-1].meta.nbytes))
    return rows


def loop_stall(runner: Any, steps: int) -> list[tuple[str, float, float]]:
    """(what, mean step s without, mean step s with) a copy of the state after every step, as the worker
    takes it: ``state_dict()`` then ``take_snapshot`` (peer tier, previous snapshot reused) or
    ``StagingPool.stage`` (durable save, buffers released once landed); one warm-up step each, then
    ``steps`` steps timed together, the device synchronized at both ends of the window."""
    import torch

    from elastictrain.checkpoint.memory_dcp import take_snapshot
    from elastictrain.checkpoint.staging import StagingPool

    def median_step(after: Any) -> float:
        # no device synchronize between steps: that would wait for the side-stream copy right away and
        # hide exactly the overlap measured here; the window ends with one
        runner.run_step(False)
        after()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.run_step(False)
            after()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    prev: list[Any] = []

    def snapshot() -> None:
        prev[:] = [take_snapshot(runner.state.state_dict(), rank=0, step=runner.step,
                                 reuse=prev[0] if prev else None)]

    pool = StagingPool()
    staged: list[Any] = []

    def stage() -> None:
        if staged:
            pool.release(staged.pop())  # the writer releases after writing; here right away
        staged.append(pool.stage(runner.state.state_dict()))

    base = median_step(lambda: None)
    rows = [("take_snapshot every step", base, median_step(snapshot))]
    rows.append(("StagingPool.stage every step", base, median_step(stage)))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,1b")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--no-staging", action="store_true")
    p.add_argument("--stall-steps", type=int, default=6, help="steps per side of the in-loop stall figure")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    name = torch.cuda.get_device_name(0)
    peak, peak_src = peak_flops(name, args.peak_tflops)
    print(f"device {name}, torch {torch.__version__}, cuda {torch.version.cuda}, "
          f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}; peak {peak / 1e12:.0f} TFLOP/s ({peak_src})",
          flush=True)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    table = []
    last_runner = None
    for size in args.sizes.split(","):
        shape = SIZES[size]
        tokens = args.global_batch * shape["seq_len"]
        for side in ("plain", "elastictrain"):  # elastictrain's state stays for the staging figures
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fn = run_elastictrain if side == "elastictrain" else run_plain
            times, peak_mem, obj = fn(size, args)
            peak_mem -= before
            model = obj.model if side == "elastictrain" else obj
            fpt = flops_per_token(model, shape["n_layer"], shape["d_model"], shape["seq_len"])
            params = sum(p.numel() for p in model.parameters())
            step_s = statistics.median(times)
            tps = tokens / step_s
            table.append((size, side, params, step_s, tps, fpt * tps / peak, peak_mem))
            print(f"  {size} {side}: step {step_s * 1e3:.1f} ms, MFU {fpt * tps / peak:.1%}, "
                  f"peak {peak_mem / 2**30:.2f} GiB", flush=True)
            if side == "elastictrain" and size == args.sizes.split(",")[-1]:
                last_runner = obj
            else:
                del obj
            del model
    print(f"\n{'size':5} {'side':13} {'params':>9} {'step ms':>9} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}")
    for size, side, params, step_s, tps, mfu, mem in table:
        print(f"{size:5} {side:13} {params / 1e6:8.1f}M {step_s * 1e3:9.1f} {tps:10.0f} {mfu:6.1%} {mem / 2**30:9.2f}")
    for size in dict.fromkeys(r[0] for r in table):
        ours = next(r for r in table if r[0] == size and r[1] == "elastictrain")
        base = next(r for r in table if r[0] == size and r[1] == "plain")
        print(f"{size}: elastictrain/plain throughput ratio {base[3] / ours[3]:.3f}, peak memory ratio "
              f"{ours[6] / base[6]:.3f}")
    if not args.no_staging and last_runner is not None:
        print(f"\nstaging of the {args.sizes.split(',')[-1]} model's training state (this rank's shard):")
        print(f"{'copy':44} {'GB/s':>6} {'pinned':>7} {'GPU GB added':>13} {'GB':>6}")
        for what, rate, pinned, gpu, nbytes in staging(last_runner):
            print(f"{what:44} {rate:6.1f} {pinned:7.1%} {gpu / 1e9:13.2f} {nbytes / 1e9:6.2f}")
        print(f"\nstall in the loop (the {args.sizes.split(',')[-1]} model; a copy after every step; the "
              f"default cadence is one peer-tier snapshot per 10 steps):")
        print(f"{'copy':32} {'step ms without':>16} {'with':>8} {'stall ms':>9} {'at 1/10 steps':>14}")
        for what, without, with_copy in loop_stall(last_runner, args.stall_steps):
            stall = with_copy - without
            print(f"{what:32} {without * 1e3:16.1f} {with_copy * 1e3:8.1f} {stall * 1e3:9.1f} "
                  f"{stall / 10 / without:14.2%}")
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
