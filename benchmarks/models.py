"""The speed options on the built-in models: ``parallel.compile``, ``parallel.float8`` and
``parallel.activation_checkpointing`` (full / selective), in one process run. Not a timed test.

CPU (default): the debug Llama (``--model gpt``: the tiny GPT) on 2 gloo processes under ddp2, fsdp2, tp2 and
pp2, eager then compiled (tokens/s ratio, loss difference), then fsdp2 without checkpointing, with full and
with selective recomputation (peak RSS growth during the steps, step time, losses), each in fresh processes::

    python benchmarks/models.py [--model llama|gpt] [--steps 6] [--warmup 2]

GPU (``--gpu``): ONE process on one CUDA GPU, world size 1 over ``cpu:gloo,cuda:nccl`` (env:// on
127.0.0.1), plan fsdp, bf16 mixed precision: a ~1B Llama (the ``1b`` size: Llama 3.2 1B's shape) and the
GPT at 1B for reference, each eager, compiled, and compiled with float8 (skipped, with the reason, where the
GPU or torchao cannot): tokens/s, MFU (elastictrain/flops.py), peak memory (``max_memory_allocated`` /
``max_memory_reserved``), losses. Ray is never imported. ``$OUT`` set: the table as ``$OUT/models_gpu.json``::

    python benchmarks/models.py --gpu [--models llama,gpt] [--steps 11] [--warmup 3] [--seq-len 2048]
        [--global-batch 16] [--micro-batch 4]

``--gpu --device cpu`` runs the same code path on the CPU with gloo and tiny sizes (a dry run, for CI).
Every variant runs ``StepRunner`` (the worker's step loop) after ``attach``: the layout a worker builds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GPT_SIZES = {"tiny": {"seq_len": 64, "n_layer": 2, "n_head": 2, "d_model": 64},
             "1b": {"seq_len": 1024, "n_layer": 20, "n_head": 16, "d_model": 2048}}
LR = 3e-4


def has_llama() -> bool:
    from elastictrain.config import TaskConfig

    return "llama" in str(TaskConfig.model_fields["kind"].annotation)


def job(model: str, size: str, *, seq_len: int | None, world: int, global_batch: int, micro_batch: int,
        parallel: dict[str, Any], gpu: bool) -> dict[str, Any]:
    """The job config (a mapping) of one variant: the built-in ``model`` at ``size``, dropout 0 (compile)."""
    if model == "llama":
        task: dict[str, Any] = {"kind": "llama", "llama": {"size": size}, "model": {"dropout": 0.0}}
        if seq_len:
            task["model"]["seq_len"] = seq_len
        if size != "debug":  # the real vocabulary (the data's bytes are tokens below it): the real head's cost
            from elastictrain.models.llama import LLAMA_PRESETS

            task["model"]["vocab_size"] = LLAMA_PRESETS[size]["vocab_size"]
    else:
        task = {"model": {**GPT_SIZES[size], "dropout": 0.0, **({"seq_len": seq_len} if seq_len else {})}}
    task["optimizer"] = {"lr": LR}
    return {"task": task, "train": {"steps": 1000, "global_batch": global_batch, "micro_batch": micro_batch},
            "workers": {"min": world, "max": world, "use_gpu": gpu},
            "parallel": parallel, "checkpoint": {"memory_every_steps": 0}}


def run_variant(spec: dict[str, Any], rank: int, world: int, device: Any, steps: int, warmup: int) -> dict[str, Any]:
    """Train ``steps`` steps of ``spec`` on this rank of the current default group (StepRunner after attach,
    seeded init): losses, median step time after ``warmup``, tokens/s, MFU, peak memory."""
    import torch

    from elastictrain.config import build_config
    from elastictrain.flops import mfu
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    cuda = device.type == "cuda"
    cfg = build_config(spec)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated() if cuda else 0
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    runner = StepRunner(builtin_task(cfg), cfg.train, FaultInjector(()), parallel=cfg.parallel, device=device)
    runner.attach(rank, world, 0, resolve(spec_from_config(cfg), world))
    if runner.uninitialized:
        runner.init_from_seed()
    losses, times, first_s = [], [], 0.0
    for s in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        record, _ = runner.run_step(False)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        losses.append(record.loss)
        if s == 0:
            first_s = elapsed
        if s >= warmup:
            times.append(elapsed)
    step_s = statistics.median(times) if times else first_s
    tps = runner.tokens_per_step / step_s
    out = {"losses": losses, "step_s": step_s, "first_step_s": first_s, "tokens_per_s": tps,
           "tokens_per_s_per_device": tps / world, "flops_per_token": runner.flops_per_token,
           "mfu": mfu(runner.flops_per_token, tps, world, runner.peak_flops),
           "params": sum(p.numel() for p in runner.model.parameters()),
           "rss_growth_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0}
    if cuda:
        out["max_allocated_bytes"] = torch.cuda.max_memory_allocated() - base_mem
        out["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    del runner
    gc.collect()
    return out


def _write_out(result: Any, name: str) -> None:
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(result, f, indent=1, default=str)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, world: int, port: int, backend: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))


def _cpu_rank(rank: int, world: int, port: int, specs: list[dict[str, Any]], steps: int, warmup: int,
              out: str) -> None:
    """One CPU rank: every spec in turn on one gloo group; rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # one rank per core: no pool of compile workers beside it
    _init_group(rank, world, port, "gloo")
    try:
        results = [run_variant(spec, rank, world, torch.device("cpu"), steps, warmup) for spec in specs]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def run_cpu_group(specs: list[dict[str, Any]], world: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    """``specs`` one after another in ``world`` fresh processes (torch.multiprocessing, spawn)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.start_processes(_cpu_rank, args=(world, _free_port(), specs, steps, warmup, out), nprocs=world,
                           start_method="spawn")
        with open(out) as f:
            return json.load(f)


LAYOUTS = {"ddp2": {"plan": "ddp"}, "fsdp2": {"plan": "fsdp"}, "tp2": {"plan": "ddp", "tp": 2},
           "pp2": {"plan": "ddp", "pp": 2}}


def loss_gap(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two loss trajectories."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def cpu_main(args: argparse.Namespace) -> dict[str, Any]:
    size = "debug" if args.model == "llama" else "tiny"
    common = {"seq_len": None, "world": 2, "global_batch": 8, "micro_batch": 2, "gpu": False}
    print(f"{args.model} {size}, 2 gloo processes, {args.steps} steps ({args.warmup} warm-up) per variant; "
          "each layout's pair in fresh processes", flush=True)
    table: dict[str, Any] = {"compile": {}, "recompute": {}}
    lines = []
    for name, layout in LAYOUTS.items():
        specs = [job(args.model, size, parallel={**layout, "compile": c}, **common) for c in (False, True)]
        try:
            e, c = run_cpu_group(specs, 2, args.steps, args.warmup)
        except Exception as err:  # noqa: BLE001 - a layout that fails is a row; the others still run
            why = str(err).strip().splitlines()[-1][:200]
            table["compile"][name] = {"failed": why}
            lines.append(f"{name:7} failed: {why}")
            print(lines[-1], flush=True)
            continue
        gap = loss_gap(c["losses"], e["losses"])
        table["compile"][name] = {"eager": e, "compiled": c, "loss_gap": gap}
        lines.append(f"{name:7} {e['tokens_per_s']:12.0f} {c['tokens_per_s']:10.0f} "
                     f"{c['tokens_per_s'] / e['tokens_per_s']:6.2f} {e['first_step_s']:13.2f} / "
                     f"{c['first_step_s']:<11.2f} {gap:13.2e}")
        print(lines[-1], flush=True)
    print(f"\n{'layout':7} {'eager tok/s':>12} {'compiled':>10} {'ratio':>6} {'1st step eager/compiled s':>27} "
          f"{'max loss gap':>13}")
    print("\n".join(lines))
    # recomputation: a longer sequence and micro-batch so that activations dominate; fresh processes per mode
    ac_common = {**common, "seq_len": args.ac_seq_len, "micro_batch": 4, "global_batch": 8}
    if args.model == "gpt":
        ac_common["seq_len"] = min(args.ac_seq_len, 256)
    print(f"\nfsdp2, seq_len {ac_common['seq_len']}, micro-batch 4: recomputation", flush=True)
    print(f"{'mode':10} {'step s':>8} {'peak RSS growth MiB':>20} {'losses == none':>15}")
    base = None
    for mode in (False, "full", "selective"):
        spec = job(args.model, size, parallel={"plan": "fsdp", "activation_checkpointing": mode}, **ac_common)
        r = run_cpu_group([spec], 2, args.steps, args.warmup)[0]
        base = base or r
        label = mode or "none"
        table["recompute"][label] = r
        print(f"{label:10} {r['step_s']:8.3f} {r['rss_growth_bytes'] / 2**20:20.1f} "
              f"{str(r['losses'] == base['losses']):>15}", flush=True)
    return table


def gpu_main(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("--gpu needs a CUDA GPU (torch.cuda.is_available() is False); --device cpu for a dry run",
                  file=sys.stderr)
            raise SystemExit(2)
        torch.cuda.set_device(0)
        from elastictrain.flops import device_peak_flops

        peak = device_peak_flops(device)
        print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuda {torch.version.cuda}; "
              f"peak {peak and peak / 1e12} TFLOP/s bf16", flush=True)
        _init_group(0, 1, _free_port(), "cpu:gloo,cuda:nccl")
        models = [(m, "1b") for m in args.models.split(",") if m != "llama" or has_llama()]
        seq = {"llama": args.seq_len, "gpt": min(args.seq_len, 1024)}
        shape = {"global_batch": args.global_batch, "micro_batch": args.micro_batch}
    else:  # the dry run: the same path, tiny sizes, gloo
        torch.set_num_threads(2)
        _init_group(0, 1, _free_port(), "gloo")
        models = [(m, "debug" if m == "llama" else "tiny") for m in args.models.split(",")
                  if m != "llama" or has_llama()]
        seq = {"llama": None, "gpt": None}
        shape = {"global_batch": 4, "micro_batch": 2}
    from elastictrain.parallel.speed import float8_unavailable

    no_float8 = float8_unavailable(device)
    rows = []
    try:
        for model, size in models:
            if model == "llama" and not has_llama():
                continue
            variants = [("eager", {}), ("compile", {"compile": True}), ("compile+float8", {"compile": True, "float8": True})]
            for name, extra in [v for v in variants if v[0] in args.variants.split(",")]:
                if extra.get("float8") and no_float8:
                    print(f"{model} {size} {name}: skipped: {no_float8}", flush=True)
                    rows.append({"model": model, "size": size, "variant": name, "skipped": no_float8})
                    continue
                parallel = {"plan": "fsdp", "mixed_precision": "bf16" if device.type == "cuda" else "none", **extra}
                spec = job(model, size, seq_len=seq[model], world=1, parallel=parallel,
                           gpu=device.type == "cuda", **shape)
                t0 = time.perf_counter()
                try:
                    r = run_variant(spec, 0, 1, device, args.steps, args.warmup)
                except Exception as e:  # noqa: BLE001 - one variant's failure is a row; the others still run
                    if args.device == "cpu":
                        raise
                    import traceback

                    traceback.print_exc()
                    rows.append({"model": model, "size": size, "variant": name, "skipped": f"failed: {e!r}"[:500]})
                    _write_out(rows, "models_gpu_partial.json")
                    continue
                r.update(model=model, size=size, variant=name, wall_s=time.perf_counter() - t0)
                rows.append(r)
                _write_out(rows, "models_gpu_partial.json")  # what ran survives a timeout
                m = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
                print(f"{model} {size} {name}: {r['tokens_per_s']:.0f} tok/s, MFU {m}, first step {r['first_step_s']:.1f} s, "
                      f"losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, {r['wall_s']:.0f} s", flush=True)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    print(f"\n{'model':6} {'size':6} {'variant':15} {'params':>8} {'tok/s':>9} {'vs eager':>9} {'MFU':>6} "
          f"{'alloc GiB':>10} {'resv GiB':>9} {'1st step s':>10}")
    for r in rows:
        eager = next((x for x in rows if x["model"] == r["model"] and x["variant"] == "eager"
                      and "skipped" not in x), None)
        if "skipped" in r or eager is None:
            print(f"{r['model']:6} {r['size']:6} {r['variant']:15} {r.get('skipped', 'no eager row')[:80]}")
            continue
        m = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(f"{r['model']:6} {r['size']:6} {r['variant']:15} {r['params'] / 1e6:7.0f}M {r['tokens_per_s']:9.0f} "
              f"{r['tokens_per_s'] / eager['tokens_per_s']:9.3f} {m:>6} "
              f"{r.get('max_allocated_bytes', 0) / 2**30:10.2f} {r.get('max_reserved_bytes', 0) / 2**30:9.2f} "
              f"{r['first_step_s']:10.1f}")
    ray = "ray" in sys.modules  # the GPU machine has no Ray: nothing on this path may import it
    print(f"ray imported: {ray}")
    return {"device": str(device), "torch": torch.__version__, "ray_imported": ray, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="one process on one GPU (module doc)")
    p.add_argument("--device", default="cuda", help="with --gpu: cuda, or cpu for a dry run of the same path")
    p.add_argument("--model", choices=["llama", "gpt"], default=None, help="CPU mode's model (default llama)")
    p.add_argument("--steps", type=int, default=None, help="steps per variant (CPU 6, GPU 11)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (CPU 2, GPU 3)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=16, help="--gpu: samples per step")
    p.add_argument("--micro-batch", type=int, default=4, help="--gpu: samples per forward (4 x 2048 tokens)")
    p.add_argument("--models", default="llama,gpt", help="--gpu: which models run (llama: the 1b size)")
    p.add_argument("--variants", default="eager,compile,compile+float8", help="--gpu: which variants run")
    p.add_argument("--ac-seq-len", type=int, default=512, help="CPU recomputation comparison's sequence length")
    args = p.parse_args(argv)
    args.steps = args.steps or (11 if args.gpu and args.device == "cuda" else 6 if not args.gpu else 3)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.gpu and args.device == "cuda" else
                                                               2 if not args.gpu else 1)
    args.model = args.model or ("llama" if has_llama() else "gpt")
    result = gpu_main(args) if args.gpu else cpu_main(args)
    _write_out(result, "models_gpu.json" if args.gpu else "models_cpu.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
