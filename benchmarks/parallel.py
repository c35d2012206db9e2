"""ddp vs fsdp vs hsdp on 4 CPU processes and ddp2 vs pp2 on 2: throughput, peak memory, bubble, in one run.

Run: ``python benchmarks/parallel.py [--world 4] [--steps 5] [--warmup 2] [--d-model 512] [--layers 16]
[--kill-steps 40] [--kill-repeats 5] [--kill-batch 32,8] [--memory-every 10] [--plans ddp,fsdp,hsdp]
[--pp 2] [--pp-schedules 1f1b] [--kill-pp] [--kill-tp] [--kill-cp] [--kill-ep] [--kill-model tiny|big]``

The pipeline targets of issue #22 on a quiet machine, one command (the 50.7M default model; every schedule
measured; ``--plans ''`` leaves out the 4-process plans; ``--kill-pp`` adds the kill runs of ddp and
pp2 x dp2 on 4 processes)::

    python benchmarks/parallel.py --plans '' --steps 8 --warmup 3 --kill-pp \
        --pp-schedules 1f1b,gpipe,interleaved_1f1b,zero_bubble,zbv

Pipeline rows (``--pp P``, default 2; ``--pp 0`` skips them): ``ddpP`` and, per schedule of
``--pp-schedules``, ``ppP-<schedule>`` (P stages, one pipeline: D = 1, so each step runs
``m = global_batch / micro_batch`` micro-batches through the schedule, 8 by default), all on P processes
with the same model, data and global batch; printed after the table, each beside its target:
* samples/s of ``ppP`` over ``ddpP`` (target >= 0.85 at m = 8: the 1f1b bubble alone costs 1/9);
* peak memory per process over ``ddpP``, the three measures of the table (target <= 0.6 at >= 50M
  parameters; a smaller ``--layers``/``--d-model`` prints the ratios without a verdict);
* the bubble: measured (the step records' ``bubble_measured``: ``1 - compute/wall`` of each rank's
  ``schedule.step``, mean over ranks and timed steps) against the schedule's timeline at unit costs
  (``elastictrain/parallel/bubble.py``; target: within 5 points at p = 2, m = 8). On CPU the measured
  share also holds the p2p waits and the schedule's Python time between chunks: on a tiny model
  (``--layers 4 --d-model 64``) they dominate, so only a model whose micro-batch compute dwarfs them (the default) speaks to the target;
* the timeline bubble of every schedule at the same p and m (targets: interleaved_1f1b below 1f1b, zbv below
  interleaved_1f1b);
* kill -> next step under pp2 x dp2 against ddp (``--kill-pp``; target <= 2x): the kill runs below, the
  tiny job on ``--world 4`` (rank 1 is stage 0's second replica: the replica source), median of
  ``--kill-repeats``; without ``--kill-pp`` the output says it was not run.
* kill -> next step under tp2 x dp2 against ddp (``--kill-tp``; target <= 2x, issue #23): both layouts on
  one job on ``--world 4``, rank 1 killed (under tp2 x dp2 tp coordinate 1 of replica 0: its shard is
  served by rank 3, the replica of its (pp, tp) coordinate, source ``peer``, which the output checks).
  Both shrink to 2 processes (ddp at 3 would break ``global_batch % (D x micro_batch)``; tp2 x dp2 keeps
  whole TP groups) and grow back when the replacement is up; at 2 and at 4 processes each rank computes
  the same share of the step under either layout (a tp rank: half the model on twice the samples). Every
  kill row also prints its phases (:func:`_kill_row`): detect, regroup, wait, the first step, and the
  layout's steady step after the kill and before it, so a reader sees how much of the figure is one step.
  The issue states its target on a >= 50M-parameter GPT: ``--kill-model big`` (the throughput rows'
  model, ``--layers`` x ``--d-model``: 50.7M by default) runs the kill rows on it, which is the figure
  the target is read on (the verdict is printed only there); the default ``--kill-model tiny`` keeps the
  tiny job's rows. The command for the target::

      python benchmarks/parallel.py --plans '' --pp 0 --tp 0 --kill-tp --kill-model big \
          --kill-steps 12 --kill-batch 16,4 --kill-repeats 3

  (16 samples a step, 4 a micro-batch: one micro-batch per rank under ddp4, two per data-parallel rank
  under tp2 x dp2; rank 1 is killed after step 3, steps 2-3 give the steady step before the kill.) On the
  tiny job the ratio is bounded by tp's own step (DTensor's dispatch and ~25 collectives per micro-batch on
  2 layers of d_model 64), so only the big model speaks to the target. Figures:
  ``docs/perf/2026-11-23-parallel-cpu.md``.
* kill -> next step under cp2 x dp2 (``--kill-cp``) and ep2 x dp2 (``--kill-ep``) against ddp on the same
  job (target <= 2x, issue #39): rank 1 killed on ``--world 4``, as above; the ep runs and their ddp runs
  train the kill model with 4 experts (top 2), so both sides run the same model. The command::

      python benchmarks/parallel.py --plans '' --pp 0 --tp 0 --kill-cp --kill-ep --kill-repeats 3

  Figures: ``docs/perf/2026-11-28-kill-cp-ep.md``.

Tensor-parallel rows (``[--tp 2]``, T = 2 by default; ``--tp 0`` skips them, issue #23): ``tpT`` (with sequence
parallel) and ``tpT-nosp`` on T processes against ``ddpT``, and ``tpTxppP`` on T*P processes (ddp over what
is left); printed after the table: samples/s and memory per process against ddpT (target: training peak
<= 0.6x at >= 50M parameters: parameters, gradients and Adam state are split T ways), and the activation
split of one micro-batch (MiB autograd keeps for backward on one rank: the norm and dropout regions, which
sequence parallel splits T ways, and the rest; target: sequence parallel's below plain TP's). Under
``tpT`` the tiny GPT needs ``n_head`` (8 here), ``4 x d_model`` and the vocabulary (256) to divide by T.

The train peak ratio tp2/ddp2 is bounded by the runtime before the model (torch, DTensor/FSDP/DCP, this
package), which no layout shards; the ``peak-base`` column leaves it out. Figures, and where the peak
goes: ``docs/perf/2026-11-23-parallel-cpu.md``.

Each plan runs the framework's own step loop (``StepRunner``: the real ``parallelize_fn``, accumulation,
clipping, AdamW) in ``--world`` spawned processes over gloo, on the built-in GPT (default 16 layers of
d_model 512, 50.7M parameters, so that the training state -- 16 bytes per parameter: params, grads, two
Adam moments, 811 MB -- dominates what every process holds whatever the plan). Same global batch, micro
batch, data and seed for every plan.

Why not the 25M the issue names as a floor: there the part no layout shards (the runtime, the dataset,
the activations) is about half of ddp's peak, so the ratio measures the runtime, not sharding (figures:
``docs/perf/2026-11-23-parallel-cpu.md``).

Figures per plan:
* samples/s: ``(steps - warmup) * global_batch / elapsed`` on rank 0 (steady state);
* peak RSS per process (max over ranks of ``ru_maxrss``: the whole life, model build included) and the
  same minus the process's RSS before the model was built (the runtime baseline), so the ratio to ddp can
  be read for the state alone too; and the training peak (max over ranks of ``VmHWM`` after it was reset
  once the warm-up steps were done: model built, optimizer state allocated), which leaves out the one-off
  build (every rank builds the whole seeded model before sharding it unless ``parallel.meta_init``);
* snapshot stall (peer memory tier): what a rank's step thread pays per snapshot -- building its DCP state
  dict (``TrainingState.state_dict``) plus ``take_snapshot`` refilling an earlier snapshot's host buffers
  (the steady state of ``MemoryReplicator.push``; sending runs on a background thread) -- measured after
  the timed steps (median of 3, max over ranks), shown per step at the default cadence
  (``checkpoint.memory_every_steps``, 10) as a share of the median step time (target <= 5%);
* time to next step after a kill (``--kill-steps N``, 0 skips it): the framework end to end on a local Ray
  (``Trainer``, the tiny job of ``jobs/tiny_gpt.yaml``: its model -- 2 layers, d_model 64, seq_len 64 --
  (``--kill-model big``: the throughput rows' model, with wider timeouts, ``BIG_TIMEOUTS``) and its
  batch -- global 32, micro 8, ``--kill-batch`` -- the same plan and world size, the peer tier at
  its default cadence, workers.min 2): rank 1 SIGKILLed by pid once step N/4 is done (the driver sees
  steps up to ~0.5 s late: at N/2 a fast ddp run could finish before its recovery); from ``os.kill`` to
  the first step completed after the ``recovered`` event (the step's ``finished_at``), with the event's source,
  and in brackets from ``os.kill`` to that event (training resumed: detection, drain, rebuild and restore,
  without the first step itself, which under fsdp costs more than a ddp step: every micro-batch all-gathers
  and reduce-scatters each block; the killed rank's replacement starts once the survivors regrouped, and on
  this 2-core machine its start-up (imports, model build: a whole core for seconds) runs beside that first
  step). More accumulation makes that first step dearer (``--kill-batch``).
  The median of ``--kill-repeats`` runs (default 5: one run varies a lot on a shared machine, and a plan's
  first run in the process more), each run's figure listed below the table. This is not the memory runs'
  model: the kill column
  measures detection and the recovery path (survivors / peer tier), which the issue bounds on the tiny job
  (< 2 s; fsdp <= 2x ddp).

Memory note: glibc keeps freed heap memory and raises its mmap threshold as large blocks come and go, so
FSDP2's per-block transient buffers (gathered parameters, unsharded gradients) inflate ``ru_maxrss`` far
above what is live. The benchmark sets ``MALLOC_MMAP_THRESHOLD_=131072`` (unless set) for its processes, for every plan alike, so blocks over
128 KiB are mmapped and returned at once and the peak reflects live memory.

Machine note: on a shared 2-core machine four processes contend for CPU; compare plans within one run only.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _layout_parallel(name: str, pp_schedule: str) -> dict:
    """A layout name's ``parallel`` config: ``ddp``/``fsdp``/``hsdp`` as is; ``pp2-zbv`` = pp 2 under that
    schedule (``pp2``: ``pp_schedule``); ``pp2xdp2`` = pp 2, ddp inside each stage (the data-parallel size
    is what the world size leaves: 2 replicas per stage on 4 processes)."""
    if name.startswith("tp"):  # tp2, tp2-nosp (no sequence parallel), tp2xpp2 (ddp over what is left)
        head, _, variant = name.partition("-")
        tp, _, pp = head[2:].partition("xpp")
        return {"plan": "ddp", "tp": int(tp), "pp": int(pp or 1), "sequence_parallel": variant != "nosp"}
    if not name.startswith("pp"):
        return {"plan": name, "shard_size": 2}
    head, _, schedule = name.partition("-")
    pp = int(head[2:].split("x")[0])
    return {"plan": "ddp", "shard_size": 2, "pp": pp, "pp_schedule": schedule or pp_schedule}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, layout: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from elastictrain import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    cfg = build_config({
        "task": {"model": {"seq_len": 64, "n_layer": args.layers, "n_head": 8, "d_model": args.d_model,
                           "dropout": 0.0}},
        "train": {"steps": args.steps, "global_batch": args.global_batch, "micro_batch": args.micro_batch},
        "workers": {"min": world, "max": world}, "parallel": _layout_parallel(layout, args.pp_schedule),
    })
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    task = builtin_task(cfg)
    baseline = _rss_kb()
    runner = StepRunner(task, cfg.train, FaultInjector([]), parallel=cfg.parallel)
    runner.attach(rank, world, 0, resolve(spec_from_config(cfg), world))
    if runner.uninitialized:  # pipeline stages: every rank keeps its stages' keys of the seeded model
        runner.init_from_seed()
    params = sum(p.numel() for p in runner.model.parameters())  # DTensors count their global size
    if runner.layout.dims.pp > 1:  # a stage rank holds its stages only: the whole model is every stage once
        per_rank = [0] * world
        dist.all_gather_object(per_rank, params)
        lay = runner.layout
        params = sum(n for r, n in enumerate(per_rank) if lay.dims.dp_rank(r) == 0 and lay.dims.coord(r)["tp"] == 0)
    t0, idle = 0.0, []
    for s in range(args.steps):
        if s == args.warmup:
            dist.barrier()
            _reset_peak_rss()  # the training peak starts here: model built, optimizer state allocated
            t0 = time.perf_counter()
        record, _ = runner.run_step(False)
        if s >= args.warmup and record.pipeline:
            idle.append(record.pipeline["bubble_measured"])
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    train_peak = _peak_rss_kb()
    stall = _snapshot_stall(runner, rank)
    bubble = statistics.mean(idle) if idle else float("nan")
    norm_mib, other_mib = _activation_split(runner, args) if runner.layout.dims.pp == 1 else (float("nan"),) * 2
    with open(os.path.join(out, f"{layout}.{rank}"), "w") as f:
        f.write(f"{elapsed} {peak} {baseline} {params} {stall} {train_peak} {bubble} {runner.layout.accum} "
                f"{norm_mib} {other_mib}\n")
    dist.destroy_process_group()


def _activation_split(runner, args: argparse.Namespace) -> tuple[float, float]:
    """MiB of activations one micro-batch's forward keeps for backward on this rank (autograd's saved tensors,
    local shards, each storage once, parameters left out), split into what the norm and dropout regions save (LayerNorm,
    SampleDropout, and the residual adds between them: sequence parallel splits those over tp) and the rest
    (attention, projections, embeddings, head, loss)."""
    import contextlib

    import torch
    from torch.distributed.tensor import DTensor

    from elastictrain.models.gpt import SampleDropout
    from elastictrain.worker.loop import _LoopHooks

    where: list[str] = ["other"]
    # parameters (which autograd saves for the matmuls' backward) are state, not activations: left out
    seen: set[int] = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                      for p in runner.pm.module.parameters()}
    sizes = {"norm": 0, "other": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        key = local.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            sizes[where[-1]] += local.untyped_storage().nbytes()
        return t

    handles = []
    for m in runner.pm.module.modules():
        if isinstance(m, (torch.nn.LayerNorm, SampleDropout)):
            handles.append(m.register_forward_pre_hook(lambda *_: where.append("norm") and None))
            handles.append(m.register_forward_hook(lambda *_: where.pop() and None))
    micro = [list(range(args.micro_batch))]
    mb = _LoopHooks(runner, 0, 1, micro, 0, 1, False).load(0)
    tp = runner.layout.dims.tp > 1
    from torch.distributed.tensor.parallel import loss_parallel

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                (loss_parallel() if tp else contextlib.nullcontext()):
            runner.task.loss_fn(runner.pm.module, mb.batch, mb.seeds)
    finally:
        for h in handles:
            h.remove()
    return sizes["norm"] / 2**20, sizes["other"] / 2**20


def _reset_peak_rss() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: ``5`` into ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_kb() -> int:
    """This process's peak RSS since the last reset, in KiB (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _snapshot_stall(runner, rank: int) -> float:
    """Median seconds of one peer-tier snapshot on the step thread (state dict + host copy, buffers reused)."""
    import statistics

    from elastictrain.checkpoint.memory_dcp import take_snapshot

    times, snap = [], None
    for _ in range(4):
        t0 = time.perf_counter()
        snap = take_snapshot(runner.state.state_dict(), rank=rank, step=runner.step, reuse=snap)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first one faults its host buffers in


TINY_MODEL = {"seq_len": 64, "n_layer": 2, "n_head": 2, "d_model": 64}  # jobs/tiny_gpt.yaml's
# the tiny job's timeouts; the big one's steps take seconds on CPU (5-15 s on a loaded 2-core machine: a hang
# bound of 20 s would be a step or two), so its bounds are wider. A SIGKILL is seen as the actor's death, and
# the survivors leave the failed step when their collectives fail on the dead peer's sockets; in one ddp run
# of six (loaded) a survivor instead waited out collective_s (then 120 s: the run's kill -> next step was
# 142 s against 9-10 s for the other two; again in one of three at 60 s: 65.6 s; no tp2 x dp2 run of seven):
# a bucket's all-reduce still running on one survivor held its group's destructor while a peer waited for
# it to close (issue #21). Survivors now sever their gloo connections first (worker/gloo_sever.py); the
# big kill rows have not been re-run since, so collective_s stays what such an outlier would cost
TINY_TIMEOUTS = {"collective_s": 15, "step_watchdog_cap_s": 20, "poll_s": 30, "restart_grace_s": 240,
                 "watchdog_floor_s": 10}
BIG_TIMEOUTS = {"collective_s": 60, "step_watchdog_cap_s": 90, "poll_s": 120, "restart_grace_s": 300,
                "watchdog_floor_s": 30}


def _kill_model(args: argparse.Namespace) -> tuple[dict, dict]:
    """The kill runs' model and timeouts: ``--kill-model tiny`` (jobs/tiny_gpt.yaml's model) or ``big`` (the
    throughput rows' model: ``--layers`` x ``--d-model``, seq_len 64, 8 heads, no dropout)."""
    if args.kill_model == "tiny":
        return TINY_MODEL, TINY_TIMEOUTS
    return ({"seq_len": 64, "n_layer": args.layers, "n_head": 8, "d_model": args.d_model, "dropout": 0.0},
            BIG_TIMEOUTS)


def _time_to_next_step_after_kill(layout: str, world: int, steps: int, batch: tuple[int, int],
                                  parallel: dict | None = None, model: dict | None = None,
                                  timeouts: dict | None = None) -> tuple[float, float, str, dict]:
    """A kill run: the job (``model``, default the tiny job's :data:`TINY_MODEL`, with ``timeouts``) under
    ``layout`` (a plan, or ``pp2xdp2``: see :func:`_layout_parallel`; ``parallel``: the job's ``parallel``
    section instead) on a local Ray; rank 1 SIGKILLed after step steps // 4. Returns (seconds from the kill
    to the first step completed after recovery, seconds to the ``recovered`` event, the recovery source, the
    phases: see :func:`_kill_row`)."""
    import signal
    import tempfile
    import threading
    from pathlib import Path

    import ray

    from elastictrain import Trainer, build_config
    from elastictrain.events import read_events

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=world, include_dashboard=False, log_to_driver=False)
    spec = {"name": f"kill-{layout}", "task": {"model": model or TINY_MODEL},
            "train": {"steps": steps, "global_batch": batch[0], "micro_batch": batch[1], "log_every": 10_000},
            "workers": {"min": 2, "max": world}, "parallel": parallel or _layout_parallel(layout, "1f1b"),
            "recovery": {"min_workers_wait_s": 240}, "timeouts": timeouts or TINY_TIMEOUTS}
    run_dir = Path(tempfile.mkdtemp(prefix=f"parallel-kill-{layout}-"))
    trainer = Trainer(build_config(spec), run_dir=run_dir, console=None)
    thread = threading.Thread(target=trainer.fit, daemon=True)
    thread.start()

    def events() -> list[dict]:
        return read_events(run_dir) if (run_dir / "events.jsonl").exists() else []

    def first(pred) -> dict | None:
        return next((e for e in events() if pred(e)), None)

    victim = None
    while thread.is_alive() and not (victim and first(lambda e: e["event"] == "step" and e["step"] >= steps // 4)):
        victim = victim or first(lambda e: e["event"] == "worker_started" and e["rank"] == 1)
        thread.join(0.05)
    if victim is None or not thread.is_alive():
        raise RuntimeError(f"{layout}: the run ended before the kill; see {run_dir}")
    t_kill = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    thread.join(600)
    evs = events()
    rec = next(i for i, e in enumerate(evs) if e["event"] == "recovered")
    nxt = next(e for e in evs[rec:] if e["event"] == "step")
    failure = next(e for e in evs if e["event"] == "failure")
    done = nxt.get("finished_at", nxt["time"])
    same = []  # the steps after the first one in the recovered generation (before a grow-back): the layout's own
    for e in evs[rec:]:
        if e["event"] == "generation_started" and same:
            break
        if e["event"] == "step" and e["step"] > nxt["step"]:
            same.append(e["step_s"])
    # the layout's own step at the full world before the kill (the first step left out: it allocates); a
    # step event's world_size is the data-parallel size, a generation's the process count
    before, procs = [], 0
    for e in evs[:rec]:
        procs = e["world_size"] if e["event"] == "generation_started" else procs
        if e["event"] == "step" and e["step"] > 1 and procs == world:
            before.append(e["step_s"])
    phases = {"detect": failure["time"] - t_kill, "regroup": evs[rec]["time"] - failure["time"],
              "first_step": nxt["step_s"], "wait": done - nxt["step_s"] - evs[rec]["time"],
              "steady_step": statistics.median(same) if same else float("nan"),
              "steady_before": statistics.median(before) if before else float("nan"),
              "world_after": evs[rec]["world_size"]}
    return done - t_kill, evs[rec]["time"] - t_kill, evs[rec]["source"], phases


def _kill_row(runs: list[tuple]) -> tuple:
    """A layout's kill figures over its runs: (median to the next step, median to the ``recovered`` event,
    sources, each run's figure, the median of each phase). Phases: ``detect``, the kill to the ``failure``
    event (the controller sees the death and the survivors leave the failed step: the event waits for their
    records); ``regroup``, that event to ``recovered`` (rendezvous, rebuild, restore); ``wait``, from there
    to the first step's start; ``first_step``, that step's own time; ``steady_step``, the median step time
    of the later steps of the same generation (the layout's own step at that world size, no recovery in
    it): ``first_step - steady_step`` is what the recovery leaves in the first step."""
    phases = {k: statistics.median(r[3][k] for r in runs) for k in runs[0][3]}
    return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
            "/".join(sorted({r[2] for r in runs})), [round(r[0], 2) for r in runs], phases)


def _print_kill_phases(kills: dict) -> None:
    for label, row in kills.items():
        ph = row[4]
        print(f"  {label} kill phases (median): detect {ph['detect']:.3f} s, regroup {ph['regroup']:.3f} s, wait "
              f"{ph['wait']:.3f} s, first step {ph['first_step']:.3f} s at {ph['world_after']:.0f} processes "
              f"(steady step there {ph['steady_step']:.3f} s; before the kill, at full world, "
              f"{ph['steady_before']:.3f} s)")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_row(label: str, layout: str, world: int, args: argparse.Namespace, out: str) -> tuple:
    """Run one layout on ``world`` spawned processes; its figures (see the module docstring)."""
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(world, _free_port(), args, layout, out), nprocs=world, start_method="spawn")
    ranks = [open(os.path.join(out, f"{layout}.{r}")).read().split() for r in range(world)]
    elapsed = float(ranks[0][0])
    step_s = elapsed / (args.steps - args.warmup)
    return Row(label=label, world=world, samples_s=(args.steps - args.warmup) * args.global_batch / elapsed,
               peak=max(int(r[1]) for r in ranks) / 1024, state=max(int(r[1]) - int(r[2]) for r in ranks) / 1024,
               params=int(ranks[0][3]), stall=max(float(r[4]) for r in ranks) / args.memory_every / step_s,
               train=max(int(r[5]) for r in ranks) / 1024,
               bubble=statistics.mean(float(r[6]) for r in ranks), accum=int(ranks[0][7]),
               act_norm=max(float(r[8]) for r in ranks), act_other=max(float(r[9]) for r in ranks))


@dataclass
class Row:
    label: str
    world: int
    samples_s: float
    peak: float  # MiB, max over ranks, whole life
    state: float  # MiB, peak minus the pre-model baseline
    params: int  # the whole model's
    stall: float  # snapshot stall per step, share of the step time
    train: float  # MiB, training peak (after the warm-up)
    bubble: float  # measured idle share of schedule.step, mean over ranks and timed steps (nan: no pipeline)
    accum: int  # micro-batches per rank per step (a pipeline's n_microbatches)
    act_norm: float = float("nan")  # MiB saved for backward by norm/dropout regions, one micro-batch (max rank)
    act_other: float = float("nan")  # MiB saved for backward by everything else


def _print_table(rows: list[Row], base: Row | None, kills: dict) -> None:
    print(f"{'layout':20} {'procs':>5} {'samples/s':>10} {'peak MiB':>9} {'x base':>6} {'peak-base MiB':>14} "
          f"{'x base':>6} {'train peak':>11} {'x base':>6} {'snap stall':>10} {'next step after kill (resumed)':>30}")
    for r in rows:
        rp = f"{r.peak / base.peak:.2f}" if base else "-"
        rs = f"{r.state / base.state:.2f}" if base else "-"
        rt = f"{r.train / base.train:.2f}" if base else "-"
        kill = f"{kills[r.label][0]:.2f} s [{kills[r.label][1]:.2f}] ({kills[r.label][2]})" if r.label in kills else "-"
        print(f"{r.label:20} {r.world:5} {r.samples_s:10.2f} {r.peak:9.0f} {rp:>6} {r.state:14.0f} {rs:>6} "
              f"{r.train:11.0f} {rt:>6} {r.stall:10.1%} {kill:>30}")


def _verdict(ok: bool) -> str:
    return "[met]" if ok else "[NOT met]"


def _print_tp_rows(tp: int, base: Row | None, rows: list[Row]) -> None:
    """The tensor-parallel rows against ddp at the same process count: throughput, memory (target <= 0.6 at
    >= 50M parameters for tp2 against ddp2) and the activation split (sequence parallel below plain TP)."""
    size = f"{base.params / 1e6:.1f}M params; " if base is not None else ""
    print(f"\ntensor-parallel rows (tp{tp}; {size}activations: MiB autograd saves for one micro-batch on one rank, "
          "norm/dropout regions + the rest)")
    for r in rows:
        line = f"  {r.label} on {r.world}: {r.samples_s:.2f} samples/s"
        if base is not None and r.world == base.world:
            x = r.train / base.train
            big = base.params >= 50e6
            line += (f", x {base.label}: samples/s {r.samples_s / base.samples_s:.3f}, train peak {x:.3f}, peak "
                     f"{r.peak / base.peak:.3f}, peak-base {r.state / base.state:.3f}" + (f" (target <= 0.6) {_verdict(x <= 0.6)}" if big else
                                                    " (model < 50M params: the 0.6 target does not apply)"))
        if r.act_norm == r.act_norm:  # not nan
            line += f"; activations {r.act_norm:.2f} + {r.act_other:.2f} = {r.act_norm + r.act_other:.2f} MiB"
        print(line)
    by = {r.label: r for r in rows}
    sp, plain = by.get(f"tp{tp}"), by.get(f"tp{tp}-nosp")
    if sp is not None and plain is not None and sp.act_norm == sp.act_norm:
        total = (sp.act_norm + sp.act_other, plain.act_norm + plain.act_other)
        print(f"  sequence parallel's activations below plain TP's at tp{tp}: {total[0]:.2f} vs {total[1]:.2f} MiB "
              f"(norm/dropout regions {sp.act_norm:.2f} vs {plain.act_norm:.2f}) {_verdict(total[0] < total[1])}")


def _print_pp_rows(pp: int, base: Row, pipes: list[Row]) -> None:
    """The issue's pipeline targets, each figure printed beside its target."""
    from elastictrain.parallel.bubble import SCHEDULES, formula_bubble, schedule_bubble
    from elastictrain.parallel.layout import default_stages_per_rank

    m = pipes[0].accum
    print(f"\npipeline rows: pp{pp} (D = 1, m = {m} micro-batches) against ddp{pp}, both on {pp} processes, "
          f"same model ({base.params / 1e6:.1f}M params), data and global batch")
    for r in pipes:
        schedule = r.label.split("-", 1)[1]
        print(f"  {r.label}: samples/s x ddp{pp} = {r.samples_s / base.samples_s:.3f} (target >= 0.85 at m = 8) "
              f"{_verdict(r.samples_s / base.samples_s >= 0.85)}")
        big = base.params >= 50e6
        ratios = [(what, a / b) for what, a, b in (("peak", r.peak, base.peak), ("peak-base", r.state, base.state),
                                                   ("train peak", r.train, base.train))]
        shown = ", ".join(f"{what} {x:.3f}" + (f" {_verdict(x <= 0.6)}" if big else "") for what, x in ratios)
        print(f"  {r.label}: memory per process x ddp{pp}: {shown} (target <= 0.6 at >= 50M params"
              f"{'' if big else '; this model is smaller: the target does not apply'})")
        timeline = schedule_bubble(schedule, pp, m, default_stages_per_rank(schedule))
        gap = abs(r.bubble - timeline) * 100
        print(f"  {r.label}: bubble measured {r.bubble:.4f} (mean over ranks and timed steps of 1 - compute/wall of "
              f"schedule.step) vs timeline {timeline:.4f}: {gap:.1f} points (target <= 5 at p = 2, m = 8) "
              f"{_verdict(gap <= 5)}")
    parts, values = [], {}
    for schedule in SCHEDULES:
        v = default_stages_per_rank(schedule)
        try:
            values[schedule] = schedule_bubble(schedule, pp, m, v)
            parts.append(f"{schedule} (v={v}) {values[schedule]:.4f}")
        except ValueError as e:
            parts.append(f"{schedule} (v={v}) refused: {e}")
    print(f"timeline bubble at p = {pp}, m = {m} (unit costs F=1 B=2 I=W=1; formula (p-1)/(m+p-1) = "
          f"{formula_bubble(pp, m):.4f}): " + ", ".join(parts))
    if {"1f1b", "interleaved_1f1b", "zbv"} <= values.keys():
        print(f"  target interleaved_1f1b < 1f1b: {_verdict(values['interleaved_1f1b'] < values['1f1b'])}; "
              f"target zbv < interleaved_1f1b: {_verdict(values['zbv'] < values['interleaved_1f1b'])}")


def _print_pp_kill(kills: dict, args: argparse.Namespace) -> None:
    if "pp2xdp2" in kills and "ddp" in kills:
        ratio = kills["pp2xdp2"][0] / kills["ddp"][0]
        print(f"  kill -> next step under pp2 x dp2: {kills['pp2xdp2'][0]:.2f} s ({kills['pp2xdp2'][2]}) vs ddp "
              f"{kills['ddp'][0]:.2f} s on {args.world} processes = {ratio:.2f}x (target <= 2x) {_verdict(ratio <= 2)}")
    else:
        print("  kill -> next step under pp2 x dp2 (target <= 2x ddp): not run (--kill-pp runs it: two "
              "more 4-process kill runs)")


TP_KILL = {"plan": "ddp", "tp": 2}  # tp2 x dp2 on 4 processes: rank 1 is tp coordinate 1 of replica 0
CP_KILL = {"plan": "ddp", "cp": 2}  # cp2 x dp2 on 4 processes: rank 1 is cp coordinate 1 of replica 0
EP_KILL = {"plan": "ddp", "ep": 2}  # ep2 x dp2 on 4 processes: rank 1 holds the experts of ep coordinate 1
MOE = {"experts": 4, "top_k": 2}  # the ep kill runs' experts (their ddp runs train the same MoE model)


def _tp_kills(args: argparse.Namespace, kills: dict) -> dict:
    """Kill runs under tp2 x dp2 (``--kill-tp``) on ``--world 4``, and ddp's on the same job if not run yet:
    rank 1 (tp coordinate 1 of data-parallel replica 0) is SIGKILLed; its shard comes from rank 3, the
    replica of its (pp, tp) coordinate. Median of ``--kill-repeats``, like the other kill rows."""
    if args.world != 4:
        raise SystemExit("--kill-tp runs tp2 x dp2: it needs --world 4")
    out = {}
    for label, parallel in (("ddp", None), ("tp2xdp2", TP_KILL)):
        if label in kills:
            continue
        out[label] = _kill_row([_time_to_next_step_after_kill(label, args.world, args.kill_steps, args.kill_batch,
                                                              parallel, *_kill_model(args))
                                for _ in range(args.kill_repeats)])
    return out


def _axis_kills(args: argparse.Namespace, axis: str) -> dict:
    """Kill runs under cp2 x dp2 (``--kill-cp``) or ep2 x dp2 (``--kill-ep``) on ``--world 4`` and ddp's on the
    same job, rank 1 SIGKILLed as in the other kill rows (median of ``--kill-repeats``). The ep runs and
    their ddp runs train the kill model with :data:`MOE` experts (ddp: every rank holds all of them), so
    both sides run the same model; the cp runs' ddp is the plain kill model's (it is the same job)."""
    if args.world != 4:
        raise SystemExit(f"--kill-{axis} runs {axis}2 x dp2: it needs --world 4")
    model, timeouts = _kill_model(args)
    if axis == "ep":
        model = {**model, "moe": MOE}
    runs = (("ddp", None), ("cp2xdp2", CP_KILL)) if axis == "cp" else (("ddp-moe", None), ("ep2xdp2", EP_KILL))
    return {label: _kill_row([_time_to_next_step_after_kill(label, args.world, args.kill_steps, args.kill_batch,
                                                            parallel or {"plan": "ddp"}, model, timeouts)
                              for _ in range(args.kill_repeats)])
            for label, parallel in runs}


def _print_axis_kill(kills: dict, args: argparse.Namespace, label: str, base: str, flag: str) -> None:
    """The ``--kill-cp`` / ``--kill-ep`` verdict: kill -> next step against ddp's on the same job (target <= 2x)."""
    if label not in kills or base not in kills:
        print(f"  kill -> next step under {label} (target <= 2x ddp): not run ({flag} runs it: two more 4-process "
              "kill runs)")
        return
    row, ddp = kills[label], kills[base]
    ratio = row[0] / ddp[0]
    print(f"  kill -> next step under {label}: {row[0]:.2f} s [{row[1]:.2f}] ({row[2]}) vs {base} {ddp[0]:.2f} s "
          f"[{ddp[1]:.2f}] ({ddp[2]}) on {args.world} processes = {ratio:.2f}x (target <= 2x) {_verdict(ratio <= 2)}")
    print(f"  one step of each (median, s): {label} {row[4]['steady_before']:.3f} at {args.world} processes, "
          f"{row[4]['steady_step']:.3f} at {row[4]['world_after']:.0f} after the kill; {base} "
          f"{ddp[4]['steady_before']:.3f}, {ddp[4]['steady_step']:.3f}; first step after recovery "
          f"{row[4]['first_step']:.3f} vs {ddp[4]['first_step']:.3f}")


def _kill_model_params(args: argparse.Namespace) -> int:
    """Parameters of the kill runs' model (built on the meta device: no memory, no init)."""
    import torch

    from elastictrain.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(GPTConfig(**{"vocab_size": 256, **_kill_model(args)[0]})).parameters())


def _kill_model_line(args: argparse.Namespace) -> str:
    """The kill runs' job in words: model, its size, batch, steps, the kill."""
    model = _kill_model(args)[0]
    return (f"{args.kill_model} model ({_kill_model_params(args) / 1e6:.1f}M params: {model['n_layer']} layers, "
            f"d_model {model['d_model']}, seq_len {model['seq_len']}), global/micro batch {args.kill_batch[0]}/"
            f"{args.kill_batch[1]}, {args.kill_steps} steps, rank 1 SIGKILLed after step {args.kill_steps // 4}, "
            f"{args.kill_repeats} runs each")


def _print_tp_kill(kills: dict, args: argparse.Namespace) -> None:
    if "tp2xdp2" in kills and "ddp" in kills:
        tp, ddp = kills["tp2xdp2"], kills["ddp"]
        ratio = tp[0] / ddp[0]
        big = _kill_model_params(args) >= 50e6
        print(f"  kill -> next step, {_kill_model_line(args)}:")
        print(f"  kill -> next step under tp2 x dp2: {tp[0]:.2f} s [{tp[1]:.2f}] ({tp[2]}) vs ddp {ddp[0]:.2f} s "
              f"[{ddp[1]:.2f}] ({ddp[2]}) on {args.world} processes = {ratio:.2f}x (target <= 2x on a >= 50M "
              f"GPT) " + (_verdict(ratio <= 2) if big else "(not the target's model: --kill-model big runs it)"))
        print(f"  tp2 x dp2 recovery source: {tp[2]} (expected peer: rank 3 holds rank 1's shard) "
              f"{_verdict(tp[2] == 'peer')}")
        print(f"  one step of each (median, s): tp2 x dp2 {tp[4]['steady_before']:.3f} at {args.world} processes, "
              f"{tp[4]['steady_step']:.3f} at {tp[4]['world_after']:.0f} after the kill; ddp "
              f"{ddp[4]['steady_before']:.3f} at {args.world}, {ddp[4]['steady_step']:.3f} at "
              f"{ddp[4]['world_after']:.0f}; first step after recovery {tp[4]['first_step']:.3f} vs "
              f"{ddp[4]['first_step']:.3f}")
    else:
        print("  kill -> next step under tp2 x dp2 (target <= 2x ddp): not run (--kill-tp runs it: two "
              "more 4-process kill runs)")


def main() -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--plans", default="ddp,fsdp,hsdp", help="data-parallel plans on --world processes ('': none)")
    p.add_argument("--pp", type=int, default=2, help="pipeline degree of the pipeline rows (0: no pipeline rows)")
    p.add_argument("--pp-schedules", default="1f1b",
                   help="schedules run as pipeline rows, comma-separated (gpipe, 1f1b, interleaved_1f1b, "
                        "zero_bubble, zbv); the timeline bubble is printed for all of them regardless")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree of the tp rows: tpT (with sequence "
                                                    "parallel), tpT-nosp and, with --pp > 1, tpTxppP (0: none)")
    p.add_argument("--kill-steps", type=int, default=40, help="steps of each kill run (0: no kill runs)")
    p.add_argument("--kill-repeats", type=int, default=5, help="kill runs per plan (the median is shown)")
    p.add_argument("--kill-batch", default=(32, 8), type=lambda v: tuple(int(x) for x in v.split(",", 1)),
                   help="global,micro batch of the kill runs' job (default 32,8: jobs/tiny_gpt.yaml's)")
    p.add_argument("--memory-every", type=int, default=10, help="peer-tier cadence the stall is shown at")
    p.add_argument("--kill-pp", action="store_true",
                   help="kill runs under pp2 x dp2 too (--world 4), against ddp's (run if not in --plans)")
    p.add_argument("--kill-tp", action="store_true",
                   help="kill runs under tp2 x dp2 too (--world 4), against ddp's (run if not in --plans)")
    p.add_argument("--kill-cp", action="store_true",
                   help="kill runs under cp2 x dp2 (--world 4) and ddp's on the same job")
    p.add_argument("--kill-ep", action="store_true",
                   help="kill runs under ep2 x dp2 (--world 4, the kill model with 4 experts, top 2) and ddp's "
                        "on the same MoE model")
    p.add_argument("--kill-model", choices=("tiny", "big"), default="tiny",
                   help="the kill runs' model: tiny (jobs/tiny_gpt.yaml's, default) or big (--layers x "
                        "--d-model, the throughput rows' model: issue #23's kill target is stated on it)")
    args = p.parse_args()
    args.pp_schedule = "1f1b"  # what a bare "ppN" layout name means (_layout_parallel)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the spawned ranks (see doc)
    out = tempfile.mkdtemp(prefix="parallel-bench-")
    plans = [_run_row(plan, plan, args.world, args, out) for plan in args.plans.split(",") if plan]
    schedules = [s for s in args.pp_schedules.split(",") if s] if args.pp > 1 else []
    base = _run_row(f"ddp{args.pp}", "ddp", args.pp, args, out) if schedules else None
    pipes = [_run_row(f"pp{args.pp}-{s}", f"pp{args.pp}-{s}", args.pp, args, out) for s in schedules]
    tp_base, tps = None, []
    if args.tp > 1:
        tp_base = base if base is not None and base.world == args.tp else _run_row(f"ddp{args.tp}", "ddp", args.tp, args, out)
        tps = [_run_row(n, n, args.tp, args, out) for n in (f"tp{args.tp}", f"tp{args.tp}-nosp")]
        if args.pp > 1:
            n = f"tp{args.tp}xpp{args.pp}"
            tps.append(_run_row(n, n, args.tp * args.pp, args, out))
    kills = {}
    killed = [row.label for row in plans]
    if args.kill_pp:
        if args.world != 4:
            raise SystemExit("--kill-pp runs pp2 x dp2: it needs --world 4")
        killed += (["ddp"] if "ddp" not in killed else []) + ["pp2xdp2"]
    for label in killed if args.kill_steps else ():
        kills[label] = _kill_row([_time_to_next_step_after_kill(label, args.world, args.kill_steps, args.kill_batch,
                                                                None, *_kill_model(args))
                                  for _ in range(args.kill_repeats)])
    if args.kill_tp and args.kill_steps:
        kills.update(_tp_kills(args, kills))
    axis_kills = {}  # their ddp rows are their own (the ep one trains the MoE model)
    for axis in ("cp", "ep"):
        if getattr(args, f"kill_{axis}") and args.kill_steps:
            axis_kills.update(_axis_kills(args, axis))
    first = (plans or [base])[0]
    model = f"params={first.params / 1e6:.1f}M " if first is not None else ""
    print(f"{model}global_batch={args.global_batch} micro_batch={args.micro_batch} "
          f"steps={args.steps} (warmup {args.warmup}) load1={os.getloadavg()[0]:.1f} "
          f"(x base: against ddp at the same process count)")
    if plans:
        _print_table(plans, next((r for r in plans if r.label == "ddp"), None), kills)
    if base is not None:
        _print_table([base, *pipes], base, {})
    for plan, (*_, each, _phases) in kills.items():
        print(f"kill runs {plan}: next step {each} s")
    _print_kill_phases(kills)
    if plans:
        print(f"snap stall: per step at memory_every_steps={args.memory_every}, share of the step time; "
              f"kill: {args.kill_model} job on a local Ray, rank 1 SIGKILLed, median of {args.kill_repeats} runs: "
              "to the next step done [to the recovered event] (recovery source)")
    if tps:
        _print_table([tp_base, *tps], tp_base, {})
        _print_tp_rows(args.tp, tp_base, tps)
    if base is not None:
        _print_pp_rows(args.pp, base, pipes)
    if base is not None or args.kill_pp:
        _print_pp_kill(kills, args)
    if args.kill_tp:
        _print_tp_kill(kills, args)
    if axis_kills:
        for plan, (*_, each, _phases) in axis_kills.items():
            print(f"kill runs {plan}: next step {each} s")
        _print_kill_phases(axis_kills)
        print(f"  kill -> next step, {_kill_model_line(args)}:")
    if args.kill_cp:
        _print_axis_kill(axis_kills, args, "cp2xdp2", "ddp", "--kill-cp")
    if args.kill_ep:
        _print_axis_kill(axis_kills, args, "ep2xdp2", "ddp-moe", "--kill-ep")


if __name__ == "__main__":
    main()
