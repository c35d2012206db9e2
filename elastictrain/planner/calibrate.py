"""``elastictrain plan --calibrate``: measure what the cost model otherwise assumes, in a few seconds.

Measured in ``ranks`` processes at once (default: as many as a node runs workers, at least 2), as the
job's ranks will run: where they share a node's cores (``Cluster.share`` ``s = ranks / cores > 1``: CPU
processes), each measured rate is what one rank gets while the others run; the compute and optimizer
figures are written as a rank on its own gets them (measured in each process's CPU time with one thread per
worker; with more, wall-clock rates times ``s``, times divided by it: ``compute_clock`` says which), which the cost
model shares out again for the world it plans (:mod:`.steptime`), the collective figures as measured
(``tp_call_s``: its CPU time times ``s``). The figures:

* ``flops``: on CPU with a built-in job, the job's own model (full width, its micro-batch; cut to
  :data:`COMPUTE_PROBE_BLOCKS` blocks at most) running forward and backward, its FLOPs
  (:func:`.steptime.step_flops`) over the time: what the model's matmuls and everything around them achieve;
  with one thread per worker in the process's CPU time (what a rank gets of a core of its own, however the
  ranks share the cores), with more in wall-clock time times the ranks per core; else a square matmul's rate
  (CPU: fp32, ``workers.cpus_per_worker`` threads; GPU 0: bf16);
* ``optimizer_s_per_param``: on CPU with a built-in job, that model's optimizer step and gradient clipping,
  per parameter, timed the same way;
* ``intra_node_bw`` / ``latency_s``: the processes all-reduce 16 MiB and one element (gloo on CPU, NCCL on
  GPUs; null with ``workers.use_gpu`` on a machine of one GPU); the bandwidth is the ring's bus bandwidth
  ``2 (n-1)/n * bytes / time`` (what :mod:`.comm` divides by), the latency the one-element all-reduce's time
  per ring step; where the processes share cores, the bandwidth of 4 MiB all-reduces made between
  stretches of compute instead (a peer off its core holds up every hop of a large message's ring);
* ``gloo_byte_s``: on CPU, the CPU time (``time.process_time``: gloo's threads included, the waits for a
  peer not) those 4 MiB all-reduces between stretches of compute cost a process beyond the compute, per
  bus byte, from every process's rounds pooled (:func:`steady_figure`); the same rounds, nothing extra is
  timed for it. A wall-clock bandwidth follows the load on the machine's other cores; this does not;
* ``call_s``: what a collective call costs between stretches of compute, as a job makes them: rounds of a
  few milliseconds of matmuls per process with and without a one-element all-reduce after each (the
  median difference, less the ring steps' latency): where processes share cores, the wait for the peers
  to be scheduled;
* ``tp_call_s``: what a tensor-parallel collective as DTensor issues it costs, over pairs of processes (a
  tp group of 2): a redistribution ``Shard -> Replicate`` (an all-gather) and one ``Partial -> Shard`` (a
  reduce-scatter) of a tiny DTensor, each waited for, after each stretch of a few ms of matmuls, against the
  matmuls alone, in CPU time (its Python work, the functional collective, gloo's thread: the process's own
  work, which the load on the machine's other cores leaves alone; waiting for the peer costs no CPU), times
  the ranks per core ``s`` (:func:`tp_call_price`: ranks that share cores take turns, so a call holds the
  node ``s`` times its CPU);
* ``dtensor_op_s``: on CPU with a built-in job, the host time DTensor's dispatch adds per op: the job's
  model cut to one block (full width: at the job's width an op under DTensor also pays for copies a plain
  one does not make), forward and backward tensor-parallel on a mesh of this process alone (no peer to
  wait for) against the same model plain, in CPU time, the difference over the DTensor ops counted in it: a
  process's own figure, which the model shares out with the node's cores like compute;
* ``fsdp_param_s``: on CPU with a built-in job, the host time FSDP2 adds per parameter tensor and
  micro-batch: the job's model cut to :data:`FSDP_PROBE_BLOCKS` blocks and narrowed to
  :data:`FSDP_PROBE_WIDTH` (its hooks' work per tensor and unit stays, the copies of the gathered and reduced
  bytes, which the model prices apart by their bytes, drop out), ``fully_shard`` per block and root as
  the job's fsdp layout applies it over pairs of processes (as ``tp_call_s``), forward and backward of one
  micro-batch against the same model plain, in the process's CPU time (gloo's threads included: the
  collectives' own work; the waits for the peer cost none), the difference over the parameter tensors: a
  process's own figure, which the model shares out with the node's cores like compute;

  all three after warm-up rounds (DTensor's sharding caches, the allocator, the code paths in the CPU's caches),
  from :data:`TP_ROUNDS` rounds in every process at once, pooled over the processes (they all measure the
  same thing), the mean of those within 3 median absolute deviations of their median
  (:func:`steady_figure`: a round that other work, a collection or a page fault inflated is dropped: one
  process's median of a few wall-clock rounds was not stable between quiet runs, see
  ``docs/perf/2026-11-23-code-figures.md``);
* ``cores_per_node``: on CPU, this machine's cores in workers' worth (``cpu_count / threads``);
* ``inter_node_bw``: the same between two Ray actors on two different nodes (one GPU each with
  ``workers.use_gpu``: NCCL), when the Ray cluster this process is connected to has several (null
  otherwise: the planner keeps its default);
* ``runtime_bytes``: on CPU, the peak resident memory of such a process once it has also run two steps of
  the job itself with its model shrunk to one block of width 8 (the built-in task: the worker's imports,
  its dataset, torch's lazily built state), i.e. what a worker of this job holds besides the model's state
  and activations; without a built-in job, the process with torch and its group up;
* ``device_memory``: on GPUs, GPU 0's memory (null on CPU: a worker's share of a node depends on how many
  run there).

The figures go to a JSON file (with ``tp_call_cpu_s``, the CPU per TP call before ``s``, and ``how``: the
samples each of the pooled figures kept) that ``parallel.calibration: PATH`` names (``elastictrain plan`` and
``parallel.plan: auto`` read it: :func:`.cluster.with_calibration`).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


def _layers(job: dict[str, Any]) -> int:
    """The blocks of a built-in task's model (``job``: its config as a mapping)."""
    task = job["task"]
    if task.get("kind") == "llama":
        from elastictrain.config import LlamaTaskConfig

        return int(LlamaTaskConfig(**task.get("llama", {})).shape()["n_layers"])
    return int(task["model"].get("n_layer", 2))


def _reshape(job: dict[str, Any], *, layers: int | None = None, width: int | None = None) -> None:
    """Cut a built-in task's model (``job``, a mapping, in place) to ``layers`` blocks and/or ``width`` wide
    with one attention head (the GPT's ``task.model``, the Llama's ``task.llama``)."""
    task = job["task"]
    if task.get("kind") == "llama":
        llama = task.setdefault("llama", {})
        if layers is not None:
            llama["n_layers"] = layers
        if width is not None:
            llama.update(dim=width, n_heads=1, n_kv_heads=1, ffn_hidden=4 * width)
        return
    if layers is not None:
        task["model"]["n_layer"] = layers
    if width is not None:
        task["model"].update(d_model=width, n_head=1)


def runtime_probe(job: dict[str, Any], rank: int, world: int) -> float:
    """Peak resident bytes of this process after two steps of ``job`` (a built-in task's config as a
    mapping) with its model shrunk to one block of width 8, as ddp over the current default group."""
    from elastictrain import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    data = json.loads(json.dumps(job))
    _reshape(data, layers=1, width=8)
    data["train"].update(steps=2, global_batch=data["train"]["micro_batch"] * world)
    data["workers"].update(min=world, max=world, spares=0)
    data["parallel"] = {"plan": "ddp"}
    data["faults"], data["checkpoint"]["uri"] = [], None
    cfg = build_config(data, source="calibration probe")
    runner = StepRunner(builtin_task(cfg), cfg.train, FaultInjector([]), parallel=cfg.parallel)
    runner.attach(rank, world, 0, resolve(spec_from_config(cfg), world))
    for _ in range(2):
        runner.run_step(False)
    return _peak_rss_bytes()


def _round_diffs(base: Any, *others: Any, rounds: int = 7, clock: Any = time.perf_counter) -> list[list[float]]:
    """For each of ``others``: its time less ``base()``'s in the same round, one sample per round (each round
    runs them all in turn, barriers between: every process runs the same thing at once, and a burst of other
    work on the machine moves one round, not the figure). ``clock``: wall time by default;
    ``time.process_time`` counts this process's own CPU work only (what other programs take is left out)."""
    import torch.distributed as dist

    diffs: list[list[float]] = [[] for _ in others]
    for _ in range(rounds):
        times = []
        for fn in (base, *others):
            dist.barrier()
            t0 = clock()
            fn()
            times.append(clock() - t0)
        for d, t in zip(diffs, times[1:]):
            d.append(t - times[0])
    return diffs


def _timed_rounds(base: Any, *others: Any, rounds: int = 7, clock: Any = time.perf_counter) -> list[float]:
    """The median over rounds of each of :func:`_round_diffs`."""
    import statistics

    return [statistics.median(d) for d in _round_diffs(base, *others, rounds=rounds, clock=clock)]


@dataclass(frozen=True)
class Steady:
    """A figure aggregated from per-round samples (:func:`steady_figure`): ``value`` (None: not measured),
    the samples kept and dropped, and why."""

    value: float | None
    kept: int
    dropped: int
    reason: str


def steady_figure(samples: Sequence[float], k: float = 3.0) -> Steady:
    """The mean of the samples within ``k`` scaled median absolute deviations of their median: a burst of
    other work, a garbage collection or a page fault inflates a round or two and is dropped, and the mean of
    the rest (a trimmed mean) varies less than one rank's median of a few rounds. ``value`` is None when
    there are no samples or the mean is not positive (the difference drowned in the noise)."""
    import statistics

    if not samples:
        return Steady(None, 0, 0, "no samples")
    mid = statistics.median(samples)
    mad = 1.4826 * statistics.median(abs(x - mid) for x in samples)  # ~ the standard deviation, robustly
    kept = [x for x in samples if abs(x - mid) <= k * mad] or [mid]
    value = statistics.fmean(kept)
    dropped = len(samples) - len(kept)
    why = f"mean of {len(kept)} of {len(samples)} samples within {k:g} MADs of the median {mid:.3g}"
    if value <= 0:
        return Steady(None, len(kept), dropped, f"{why}: {value:.3g} <= 0, lost in the noise")
    return Steady(value, len(kept), dropped, why)


def _pooled(samples: list[float]) -> list[float]:
    """Every process's samples (collective: every process calls it): they all measure the same thing at
    once, so one figure from all of them rather than rank 0's few."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, samples)
    return [x for got in every for x in got]


def tp_call_price(cpu_per_call: float | None, share: float) -> float | None:
    """``tp_call_s`` from the CPU seconds a rank spends per TP call (:func:`tp_call_figure`): times ``share``
    (ranks per core, at least 1: they take turns on the cores, so each call holds the node that much
    longer). Nothing is taken off for the ring steps' latency that the model adds per call: the CPU time
    holds no wait for a peer (the wall-clock figure before it did, and took 1.5 latencies off). None when
    it was not measured."""
    return None if cpu_per_call is None else cpu_per_call * max(1.0, share)


CONTENDED_BYTES = 4 << 20


def contended_figures(world: int, reps: int = 10) -> tuple[float | None, float | None, Steady]:
    """``(seconds per call, bus bandwidth, CPU per bus byte)`` of all-reduces made between stretches of
    compute (a few ms of matmuls; module docstring: ``call_s``): one element, then :data:`CONTENDED_BYTES`,
    each against the compute alone. Where processes share cores this is what a job's collectives get: a
    peer may be off its core, and a large message waits on every hop of its ring. The first two ``None``
    when the differences drown in the noise of other work on the machine. The CPU per byte
    (``gloo_byte_s``): the same rounds in the process's CPU time (gloo's threads included), the large
    all-reduces' less the compute's, per byte, pooled over the processes (:func:`steady_figure`; every
    process calls this at once)."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    tiny, big = torch.ones(1), torch.ones(CONTENDED_BYTES // 4)
    cpu: dict[int, list[float]] = {0: [], CONTENDED_BYTES: []}

    def loop(t: torch.Tensor | None) -> Any:
        def run() -> None:
            c0 = time.process_time()
            for _ in range(reps):
                for _ in range(16):
                    a @ b
                if t is not None:
                    dist.all_reduce(t)
            if t is None or t is big:
                cpu[0 if t is None else CONTENDED_BYTES].append(time.process_time() - c0)
        return run

    call, big_s = (d / reps for d in _timed_rounds(loop(None), loop(tiny), loop(big)))
    moved = 2 * (world - 1) / world * CONTENDED_BYTES
    byte = steady_figure(_pooled([(c - c_base) / (reps * moved) for c_base, c in zip(cpu[0], cpu[CONTENDED_BYTES])]))
    if big_s <= 0 or call <= 0:  # lost in the noise of other work on the machine: not measured
        return None, None, byte
    # the bytes' share of a large call (at least half of it: two noisy differences must not leave ~0)
    return call, moved / max(big_s - call, big_s / 2), byte


TP_ROUNDS = 12  # per process, pooled over the processes (steady_figure)


def _settled(t: Any) -> Any:
    """``t`` once its collective has finished (DTensor may return an async result: a step's next op waits)."""
    return t.wait() if hasattr(t, "wait") else t


def tp_call_figure(rank: int, world: int, reps: int = 10, rounds: int = TP_ROUNDS) -> Steady:
    """CPU seconds per tensor-parallel collective as DTensor issues it over pairs of processes (module
    docstring: ``tp_call_s``, before :func:`tp_call_price`), pooled over the pairs' processes."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    # every process creates every group, in the same order (new_group is collective over the world)
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]
    solo = dist.new_group([world - 1]) if world % 2 else None
    group = pairs[rank // 2] if rank // 2 < len(pairs) else solo
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    sharded = DTensor.from_local(torch.ones(1, 2, 4), mesh, [Shard(1)], run_check=False)
    partial = DTensor.from_local(torch.ones(1, 4, 4), mesh, [Partial()], run_check=False)

    def loop(tp: bool) -> Any:
        def run() -> None:
            for _ in range(reps):
                for _ in range(8):  # a few ms of compute between calls, as a step's blocks leave them
                    a @ b
                if tp:
                    _settled(sharded.redistribute(mesh, [Replicate()]).to_local())
                    _settled(partial.redistribute(mesh, [Shard(1)]).to_local())
        return run

    # warm-up, both loops: DTensor's sharding caches, the allocator, the code paths in the caches
    _round_diffs(loop(False), loop(True), rounds=2, clock=time.process_time)
    # CPU time: the call's own work (Python, functional collective, gloo's thread), which does not depend
    # on how busy the machine's other cores are; the waits for the peer cost no CPU
    (diffs,) = _round_diffs(loop(False), loop(True), rounds=rounds, clock=time.process_time)
    in_pair = world % 2 == 0 or rank < world - 1  # a lone last process has no peer to measure with
    return steady_figure(_pooled([d / (2 * reps) for d in diffs] if in_pair else []))


def dtensor_op_figure(job: dict[str, Any], rank: int, world: int, reps: int = 2,
                      rounds: int = TP_ROUNDS) -> Steady:
    """CPU seconds DTensor's dispatch adds per op (module docstring: ``dtensor_op_s``), in each process while
    the others measure the same, pooled over them (:func:`steady_figure`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.utils._python_dispatch import TorchDispatchMode

    from elastictrain.parallel.tensor import local_loss, parallelize_tp

    solos = [dist.new_group([r]) for r in range(world)]  # collective: every process creates all of them
    mesh = DeviceMesh.from_group(solos[rank], "cpu", mesh_dim_names=("tp",))
    cfg, task, batch, seeds = _one_block_probe(job)
    plain = task.model_fn()
    sharded = parallelize_tp(task.model_fn(), mesh, cfg.parallel)

    def plain_step() -> None:
        for _ in range(reps):
            task.loss_fn(plain, batch, seeds).sum().backward()

    def tp_step() -> None:
        for _ in range(reps):
            with loss_parallel():
                local_loss(task.loss_fn(sharded, batch, seeds)).sum().backward()

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if any(issubclass(t, DTensor) for t in types):
                _Count.ops += 1
            return func(*args, **(kwargs or {}))

    plain_step()
    tp_step()  # warm-up: DTensor's sharding caches, the gradients exist from here (accumulated after)
    with _Count():
        tp_step()
    # warm-up after the counting mode, both steps, as timed: the allocator's blocks, the code paths in caches
    _round_diffs(plain_step, tp_step, rounds=1, clock=time.process_time)
    # CPU time: the dispatch is this process's own work, which other programs on the machine do not change
    (diffs,) = _round_diffs(plain_step, tp_step, rounds=rounds, clock=time.process_time)
    return steady_figure(_pooled([d / _Count.ops for d in diffs] if _Count.ops else []))



FSDP_PROBE_BLOCKS = 4  # blocks of the fsdp_param_s probe (at most the job's): 69 parameter tensors of the GPT
FSDP_PROBE_WIDTH = 8   # its width: the copies of the gathered and reduced bytes, priced apart, drop out


def fsdp_param_figure(job: dict[str, Any], rank: int, world: int, reps: int = 2,
                      rounds: int = TP_ROUNDS) -> Steady:
    """CPU seconds FSDP2 adds per parameter tensor and micro-batch (module docstring: ``fsdp_param_s``), over
    pairs of processes, in each process while the others measure the same, pooled (:func:`steady_figure`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from elastictrain.parallel.parallelize import parallelize_fsdp

    pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]  # collective: every process, in order
    solo = dist.new_group([world - 1]) if world % 2 else None
    group = pairs[rank // 2] if rank // 2 < len(pairs) else solo
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("fsdp",))
    narrow = json.loads(json.dumps(job))
    layers = min(FSDP_PROBE_BLOCKS, _layers(narrow))
    _reshape(narrow, width=FSDP_PROBE_WIDTH)
    cfg, task, batch, seeds = _one_block_probe(narrow, layers=layers)
    plain = task.model_fn()
    sharded = parallelize_fsdp(task.model_fn(), mesh, cfg.parallel)
    tensors = sum(1 for _ in sharded.parameters())

    def step(model: Any) -> Any:
        def run() -> None:
            for _ in range(reps):
                task.loss_fn(model, batch, seeds).sum().backward()
        return run

    # warm-up, both: FSDP's lazy init, the allocator, the code paths in the caches
    _round_diffs(step(plain), step(sharded), rounds=2, clock=time.process_time)
    # CPU time of the process (its gloo threads too): the hooks' own work, not the waits for the peer
    (diffs,) = _round_diffs(step(plain), step(sharded), rounds=rounds, clock=time.process_time)
    in_pair = world % 2 == 0 or rank < world - 1
    return steady_figure(_pooled([d / (reps * tensors) for d in diffs] if in_pair else []))


def _one_block_probe(job: dict[str, Any], layers: int = 1) -> tuple[Any, Any, dict[str, Any], Any]:
    """``(config, task, batch, sample ids)`` for a probe of the job's model cut to ``layers`` blocks: its config
    as a one-worker ddp job without faults or checkpoints, its task, and one random micro-batch."""
    import torch

    from elastictrain import build_config
    from elastictrain.task import builtin_task

    data = json.loads(json.dumps(job))
    _reshape(data, layers=layers)
    data["parallel"] = {"plan": "ddp"}
    data["faults"], data["checkpoint"]["uri"] = [], None
    cfg = build_config(data, source="calibration probe")
    mb, seq = cfg.train.micro_batch, cfg.task.model.seq_len
    tokens = torch.randint(0, 256, (mb, seq + 1))
    return cfg, builtin_task(cfg), {"input": tokens[:, :-1], "target": tokens[:, 1:]}, torch.arange(mb)


# The blocks of the compute probe (the whole model up to this many): a model's rate falls with its depth on CPU
# (more activations than the caches hold), so one block priced the job's compute fast: on a 2-core machine, the
# benchmark's d=384 GPT in CPU time, 4 processes at once: 1 block 89-95 GFLOP/s, 4 blocks 85-91, all 12 76-79.
COMPUTE_PROBE_BLOCKS = 12


def job_compute_figures(job: dict[str, Any], seconds: float = 1.0,
                        clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """``(FLOP/s, optimizer seconds per parameter)`` of the job's model (cut to :data:`COMPUTE_PROBE_BLOCKS`
    blocks at most), forward and backward of one micro-batch, then clipping and the optimizer step, in this
    process (no collective), timed by
    ``clock`` (``time.process_time``: the process's own CPU work, what it would take on a core of its own,
    whatever else shares the cores)."""
    import torch

    from elastictrain.planner.inputs import Candidate, Training
    from elastictrain.planner.job import model_shape
    from elastictrain.planner.steptime import step_flops

    blocks = min(_layers(job), COMPUTE_PROBE_BLOCKS)
    cfg, task, batch, seeds = _one_block_probe(job, layers=blocks)
    mb = cfg.train.micro_batch
    model = task.model_fn()
    opt = task.optimizer_fn(model.parameters())
    flops = step_flops(model_shape(cfg), Training(global_batch=mb, micro_batch=mb), Candidate(micro_batch=mb))
    params = sum(p.numel() for p in model.parameters())

    def fwd_bwd() -> None:
        task.loss_fn(model, batch, seeds).sum().backward()

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        opt.step()

    import statistics

    fwd_bwd()
    update()  # warm-up: the optimizer's state exists from here
    compute_s, optimizer_s, t_end = [], [], time.perf_counter() + seconds
    while len(compute_s) < 3 or time.perf_counter() < t_end:
        t0 = clock()
        fwd_bwd()
        t1 = clock()
        update()
        compute_s.append(t1 - t0)
        optimizer_s.append(clock() - t1)
        opt.zero_grad(set_to_none=False)
    # medians: a burst of other work on the machine moves one iteration, not the figure
    return flops / statistics.median(compute_s), statistics.median(optimizer_s) / params


def _peak_rss_bytes() -> float:
    with open("/proc/self/status") as f:
        return next(float(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def all_reduce_figures(rank: int, world: int, store_addr: tuple[str, int], use_gpu: bool,
                       threads: int = 1, job: dict[str, Any] | None = None,
                       gpu_index: int | None = None, probes: bool = True) -> dict[str, float]:
    """In each of ``world`` processes: join a group over a TCP store at ``store_addr`` (rank 0 hosts it),
    time all-reduces, and return bus bandwidth, latency and resident bytes (after :func:`runtime_probe`
    of ``job`` when given, on CPU); with ``probes`` on CPU also ``call_s`` and ``contended_bw``
    (:func:`contended_figures`), ``flops`` and ``optimizer_s_per_param`` (:func:`job_compute_figures` of
    ``job``, else a matmul), all processes at once. ``gpu_index``: the GPU to use (default: ``rank``, one machine's GPUs; a Ray actor
    sees its one GPU as 0)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, threads))
    index = rank if gpu_index is None else gpu_index
    gpu = use_gpu and torch.cuda.is_available() and torch.cuda.device_count() > index
    device = torch.device("cuda", index) if gpu else torch.device("cpu")
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
        del big, tiny
        figures = {"bus_bw": bw, "latency_s": latency}
        # the resident peak first: the probes below build a model of the job's width
        figures["rss_bytes"] = runtime_probe(job, rank, world) if job is not None and not gpu else _rss_bytes()
        if probes and not gpu:
            call, figures["contended_bw"], byte = contended_figures(world)
            figures["gloo_byte_s"], figures["gloo_byte_how"] = byte.value, byte.reason
            figures["call_s"] = None if call is None else max(0.0, call - 2 * (world - 1) * latency)
            tp_call = tp_call_figure(rank, world)
            figures["tp_call_cpu_s"], figures["tp_call_how"] = tp_call.value, tp_call.reason
            if job is not None:
                op = dtensor_op_figure(job, rank, world)
                figures["dtensor_op_s"], figures["dtensor_op_how"] = op.value, op.reason
                visit = fsdp_param_figure(job, rank, world)
                figures["fsdp_param_s"], figures["fsdp_param_how"] = visit.value, visit.reason
            if job is not None:
                dist.barrier()  # every process computes at once, as the job's ranks do
                # one thread: in CPU time, a rank's own work (the module docstring); more: wall-clock
                clock = time.process_time if threads <= 1 else time.perf_counter
                figures["flops"], figures["optimizer_s_per_param"] = job_compute_figures(job, clock=clock)
                figures["compute_clock"] = "cpu" if threads <= 1 else "wall"
            else:
                dist.barrier()
                figures["flops"] = matmul_flops(False, threads)
        return figures
    finally:
        dist.destroy_process_group()


def _timeout():  # noqa: ANN202
    from datetime import timedelta

    return timedelta(seconds=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, use_gpu: bool, threads: int, job: Any, queue: Any) -> None:
    queue.put((rank, all_reduce_figures(rank, world, ("127.0.0.1", port), use_gpu, threads, job)))


def local_all_reduce(use_gpu: bool, threads: int = 1, world: int = 2,
                     job: dict[str, Any] | None = None) -> dict[str, float]:
    """Rank 0's figures of ``world`` processes of this machine all-reducing (module docstring)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, use_gpu, threads, job, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=600) for _ in procs)
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
    need = "GPU" if use_gpu else "CPU"
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(need, 0) >= 1
             and n["Resources"].get("CPU", 0) >= 1]
    if len(nodes) < 2:
        return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote
    class _Peer:
        def address(self) -> tuple[str, int]:
            return ray.util.get_node_ip_address(), _free_port()

        def run(self, rank: int, addr: tuple[str, int]) -> dict[str, float]:
            return all_reduce_figures(rank, 2, addr, use_gpu, threads, gpu_index=0, probes=False)

    peers = [_Peer.options(num_cpus=1, num_gpus=1 if use_gpu else 0,
                           scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
             for n in nodes[:2]]
    try:
        addr = ray.get(peers[0].address.remote(), timeout=120)
        figures = ray.get([p.run.remote(r, addr) for r, p in enumerate(peers)], timeout=300)
        return figures[0]["bus_bw"]
    finally:
        for p in peers:
            ray.kill(p)


def calibrate(use_gpu: bool, nodes: int = 1, threads: int = 1, job: dict[str, Any] | None = None,
              ranks: int | None = None) -> dict[str, Any]:
    """Every figure of the module docstring, with where and when it was measured. ``job``: a built-in
    task's config as a mapping, for ``runtime_bytes``, ``flops`` and ``optimizer_s_per_param`` on CPU
    (None: torch and its group only, a square matmul). ``ranks``: the processes measured at once (default:
    a node's workers, at least 2)."""
    import torch

    gpus = torch.cuda.device_count() if use_gpu and torch.cuda.is_available() else 0
    cores = (os.cpu_count() or 1) / max(1, threads)
    n = max(2, ranks or (gpus if use_gpu else int(cores)))
    # on GPUs the link that matters is between two of them: with fewer there is nothing to measure (the
    # default stays), and a gloo figure between CPU processes would be the wrong link
    local = local_all_reduce(use_gpu, threads, world=min(n, gpus) if use_gpu else n, job=job) \
        if not use_gpu or gpus >= 2 else {}
    share = 1.0 if use_gpu else max(1.0, n / cores)  # the rates of a rank alone (module docstring)
    # compute timed in CPU time is already a rank's own (a wall-clock rate is what a rank got of its share)
    alone = 1.0 if local.get("compute_clock") == "cpu" else share
    # ranks sharing cores: their collectives move bytes at the contended rate (kept as measured)
    # (not measured: the bus bandwidth shared out)
    bw = local.get("bus_bw") and (local.get("contended_bw") or local["bus_bw"] / share if share > 1
                                  else local["bus_bw"])
    optimizer = local.get("optimizer_s_per_param")
    figures: dict[str, Any] = {
        "flops": local["flops"] * alone if "flops" in local else matmul_flops(use_gpu, threads),
        "intra_node_bw": bw,
        "inter_node_bw": cross_node_all_reduce(use_gpu, threads) if nodes > 1 else None,
        "latency_s": _positive(local.get("latency_s")),
        "call_s": _positive(local.get("call_s")),
        "tp_call_s": _positive(tp_call_price(local.get("tp_call_cpu_s"), share)),
        "dtensor_op_s": _positive(local.get("dtensor_op_s")),  # CPU time: the model shares it out itself
        "fsdp_param_s": _positive(local.get("fsdp_param_s")),  # CPU time, likewise
        # CPU time per byte moved, likewise (a fraction of a ns: not floored at _positive's 1 ns)
        "gloo_byte_s": local.get("gloo_byte_s") if (local.get("gloo_byte_s") or 0) > 0 else None,
        "tp_call_cpu_s": local.get("tp_call_cpu_s"),  # CPU per call, before the share
        "how": {k: local[f"{k}_how"] for k in ("tp_call", "dtensor_op", "fsdp_param", "gloo_byte")
                if f"{k}_how" in local},
        "optimizer_s_per_param": _positive(optimizer / alone if optimizer else None),
        "compute_clock": local.get("compute_clock"),
        "cores_per_node": None if use_gpu else cores,
        "ranks": n,
        "runtime_bytes": None if use_gpu else local.get("rss_bytes"),
        "device_memory": float(torch.cuda.get_device_properties(0).total_memory) if gpus else None,
        "kind": "gpu" if use_gpu else "cpu",
        "threads": threads,
        "host": platform.node(),
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load": os.getloadavg()[0],
    }
    return figures


def _positive(value: float | None) -> float | None:
    """A measured time that rounds to nothing is written as 1 ns (a calibration file's figures are > 0)."""
    return None if value is None else max(value, 1e-9)


def write(figures: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(figures, indent=1) + "\n")
    return p
