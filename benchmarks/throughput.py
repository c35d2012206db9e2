"""Steady-state training throughput: elastictrain DDP vs a hand-written torchrun DDP script.

Run: ``python benchmarks/throughput.py [--steps N] [--rounds R] [--warmup W] [--dropouts 0.1,0] [--ablation]
[--no-cpu]``

Both sides train the built-in tiny GPT with the same global batch, micro batch, step count, optimizer,
grad clip, LR schedule, dataset and one intra-op thread per worker, on 2 CPU workers. A round is a pair of
runs, one of each side, back to back; the side that goes first alternates from round to round (AB, BA, AB,
...), so a machine that drifts within a pair favours each side equally often. The headline figure is the
median over the rounds of each pair's own ratio, with its spread (min, quartiles, max): many short pairs
follow the drift of a VM's CPU better than a few long ones.

The window skips the run's start-up on both sides (the same ``--warmup`` steps, 300 by default):
elastictrain's first standby process starts with the first workers, at their priority, and its ~5 CPU-s of
imports and set-up overlap the first seconds of training on a small machine; a training run pays that
once, a window that starts 30 steps in would measure mostly it. Where CPU figures are on, a pair whose
window still holds the standby's start is marked in the table.

Both sides' training processes run at nice 0 (Ray's workers would otherwise start at nice 15, below Ray's
own daemons and the driver), and neither side checkpoints (durable or peer memory tier).

* elastictrain: ``Trainer(...).fit()``, which starts its own private Ray as ``elastictrain run`` does
  (``elastictrain/local_ray.py``: system config, daemon settings; worker output to the driver), stopped
  after each run: the plain rounds run with no Ray up. Throughput comes from the ``step`` events of
  ``events.jsonl``.
* plain: ``benchmarks/plain_ddp.py`` under ``python -m torch.distributed.run --nproc_per_node=2``; rank 0
  records ``time.time()`` after each optimizer step.

Steady state (both sides, same function): skip the first W steps, then
``(N - W) * global_batch / (t[N] - t[W])`` where ``t[s]`` is the time of step ``s``.

One clock for both sides: ``t[s]`` is rank 0's ``time.time()`` right after the optimizer step of step
``s``. The plain script records it itself; for elastictrain it is the step event's ``finished_at`` field,
which rank 0's worker stamps at the same point of its loop (not the driver's ``time`` field, which is when
the controller's poll observed the step and is batched by polling). A second, load-robust figure uses the
same clock: ``G / median(t[s] - t[s-1])`` (the typical step).

elastictrain's per-step (loss, stop flag) word rides inside DDP's last gradient bucket (a DDP comm hook,
``elastictrain/worker/step_stats.py``), so neither side issues a collective beyond DDP's gradient
all-reduce. ``--ablation`` adds a third run per round: plain DDP plus a separate (loss, stop) all-reduce
(``plain_ddp.py --stats-allreduce``), what elastictrain paid before the hook.

Rows are run for each ``--dropouts`` value (default 0.1 and 0.0): dropout in the tiny GPT draws per-sample
masks on both sides; the ``dropout=0`` rows show the comparison without that cost.

CPU (``benchmarks/side_cpu.py``; ``--no-cpu`` leaves it out): each side's CPU-s per step over the same window
and by role: the whole side (a cgroup-v1 cpuacct group per side, where ``/sys/fs/cgroup/cpuacct`` is
writable; elastictrain's holds this script, Ray's daemons and every Ray worker process), the two training
processes, the launcher (elastictrain: this script's process, the driver; plain: torchrun's agent) and the
rest; and the wake-ups per second of the training processes' threads (voluntary context switches). CPU
seconds hold on a shared machine where wall time does not: they are the evidence for what each side adds.

The machine is shared: the ``load`` column is the 1-minute load average after each pair of runs; on 2 cores,
a value well above 2 means other processes took CPU from the workers and the round is noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from side_cpu import (CpuGroup, RayRoles, Sampler, SideCpu, cgroup_unavailable, children,  # noqa: E402
                      one_line, wrap_in_group)

PLAIN_SCRIPT = HERE / "plain_ddp.py"
RESULT_PREFIX = "PLAIN_DDP_RESULT "
TARGET_RATIO = 0.97
# Above this, the standby's CPU in a window is its start (imports, set-up), not an idle actor's signal checks.
STANDBY_STARTING = 1e-3

# The one job both sides run (mirrors jobs/tiny_gpt.yaml, checkpoints off: the baseline does not save).
MODEL = {"seq_len": 64, "n_layer": 2, "n_head": 2, "d_model": 64, "dropout": 0.1}
OPTIM = {"lr": 3.0e-3, "warmup_steps": 10, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0}
SEED = 0
WORLD = 2


@dataclass(frozen=True)
class Measure:
    samples_per_s: float          # steady-state figure on rank 0's clock, as defined in the module docstring
    wall_s: float = 0.0           # whole run, start-up included (for information)
    robust_samples_per_s: float = 0.0  # G / median step interval over the same window (rank 0's clock)
    load: float = 0.0             # 1-minute load average right after the run: >2 means others shared the cores
    note: str = ""
    cpu: SideCpu | None = None    # CPU-s per step over the same window (benchmarks/side_cpu.py)


def steady_state(times: list[float], warmup: int, global_batch: int) -> float:
    """``(N - W) * G / (t[N] - t[W])`` for 1-based step times ``times[s-1]``. Raises ValueError if the
    window is empty."""
    n = len(times)
    if n <= warmup + 1 or warmup < 1:
        raise ValueError(f"{n} steps leave no steady-state window after warmup={warmup} (need warmup >= 1 "
                         f"and steps > warmup + 1); raise --steps or lower --warmup")
    elapsed = times[n - 1] - times[warmup - 1]
    if elapsed <= 0:
        raise ValueError(f"non-positive window duration {elapsed!r}s")
    return (n - warmup) * global_batch / elapsed


def steady_state_robust(times: list[float], warmup: int, global_batch: int) -> float:
    """``G / median(t[s] - t[s-1])`` over the same window: insensitive to a few steps that another process
    on the shared cores stretched (it measures the typical step, not the average)."""
    steady_state(times, warmup, global_batch)  # same validation
    window = times[warmup - 1:]
    return global_batch / statistics.median(b - a for a, b in zip(window, window[1:]))


# ------------------------------------------------------------------------------------------ elastictrain


def _job(steps: int, global_batch: int, micro_batch: int, dropout: float, standby: bool = True) -> dict[str, Any]:
    opt = {k: OPTIM[k] for k in ("lr", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip")}
    return {
        "name": "throughput",
        "task": {"kind": "tiny_gpt", "model": {**MODEL, "dropout": dropout}, "data": {"source": "builtin:pydoc"},
                 "optimizer": opt},
        "train": {"steps": steps, "seed": SEED, "global_batch": global_batch, "micro_batch": micro_batch,
                  "log_every": steps},
        "workers": {"min": WORLD, "max": WORLD, "cpus_per_worker": 1.0, "standby": standby},
        "checkpoint": {"uri": None, "every_steps": 0, "memory_every_steps": 0, "resume": "never"},
    }


def run_elastictrain(steps: int, global_batch: int, micro_batch: int, warmup: int, dropout: float,
                     cpu: dict[str, CpuGroup] | None = None, standby: bool = True) -> Measure:
    """``cpu``: None for no CPU figures; else the sides' cgroups ({} where there are none). ``standby``:
    ``workers.standby`` (the default, true, unless an ablation asks otherwise)."""
    import ray

    from elastictrain import Trainer, build_config

    config = build_config(_job(steps, global_batch, micro_batch, dropout, standby),
                          source="benchmarks/throughput.py")
    with tempfile.TemporaryDirectory(prefix="et-bench-") as tmp:
        events_path = Path(tmp) / "events.jsonl"
        workers: dict[int, str] = {}
        ray_roles = RayRoles()

        def roles() -> dict[int, str]:
            if len(workers) < WORLD and events_path.exists():
                for line in events_path.read_text().splitlines():
                    if '"worker_started"' in line:
                        workers[json.loads(line)["pid"]] = "training"
            return {**ray_roles(), os.getpid(): "launcher", **workers}

        sampler = Sampler(cpu, roles) if cpu is not None else None
        t0 = time.time()
        try:  # Trainer starts its private Ray as `elastictrain run` does; stopped after: plain runs with none
            result = Trainer(config, run_dir=tmp, console=None).fit()
        finally:
            if sampler is not None:
                sampler.stop()
            ray.shutdown()
        wall = time.time() - t0
        events = [json.loads(line) for line in events_path.read_text().splitlines() if line]
    if not result.ok:
        raise RuntimeError(f"elastictrain run failed (exit {result.exit_code}): {result.summary.get('error')}")
    bad = [e for e in events if e["event"] in ("failure", "resized", "straggler", "worker_lost")]
    steps_ev = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["step"])
    if [e["step"] for e in steps_ev] != list(range(1, steps + 1)):
        raise RuntimeError(f"expected step events 1..{steps}, got {len(steps_ev)}")
    if any(e["world_size"] != WORLD for e in steps_ev):
        raise RuntimeError("a step ran at a world size other than 2: the comparison would be meaningless")
    note = ", ".join(sorted({e["event"] for e in bad}))
    times = [e["finished_at"] for e in steps_ev]  # rank 0's clock after the optimizer step, like the plain script
    side = None
    if sampler is not None:
        side = sampler.window(times[warmup - 1], times[-1], steps - warmup, "elastictrain", None)
    return Measure(steady_state(times, warmup, global_batch), wall,
                   steady_state_robust(times, warmup, global_batch), os.getloadavg()[0], note, side)


# ------------------------------------------------------------------------------------------ plain DDP


def run_plain(steps: int, global_batch: int, micro_batch: int, warmup: int, dropout: float,
              stats_allreduce: bool = False, cpu: dict[str, CpuGroup] | None = None) -> Measure:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
           "--standalone", str(PLAIN_SCRIPT), "--steps", str(steps), "--global-batch", str(global_batch),
           "--micro-batch", str(micro_batch), "--seed", str(SEED)]
    for key, value in {**MODEL, "dropout": dropout}.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    for key, value in OPTIM.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if stats_allreduce:
        cmd.append("--stats-allreduce")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.Popen(wrap_in_group((cpu or {}).get("plain"), cmd), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    ranks: dict[int, str] = {}

    def roles() -> dict[int, str]:  # the shell execs torchrun: same pid; its children are the ranks
        if len(ranks) < WORLD:
            ranks.update({c: "training" for c in children(proc.pid)})
        return {proc.pid: "launcher", **ranks}

    sampler = Sampler(cpu, roles) if cpu is not None else None
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if sampler is not None:
            sampler.stop()
    wall = time.time() - t0
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        tail = (stdout + stderr)[-3000:]
        raise RuntimeError(f"plain DDP run failed (exit {proc.returncode}):\n{tail}")
    out = json.loads(lines[-1][len(RESULT_PREFIX):])
    if out["world_size"] != WORLD or out["threads"] != 1 or len(out["times"]) != steps:
        raise RuntimeError(f"plain DDP ran an unexpected layout: {({k: v for k, v in out.items() if k != 'times'})}")
    side = None
    if sampler is not None:
        side = sampler.window(out["times"][warmup - 1], out["times"][-1], steps - warmup, "plain", "elastictrain")
    return Measure(steady_state(out["times"], warmup, global_batch), wall,
                   steady_state_robust(out["times"], warmup, global_batch), os.getloadavg()[0], cpu=side)


# ------------------------------------------------------------------------------------------ report


@dataclass(frozen=True)
class Round:
    index: int
    dropout: float
    et: Measure
    plain: Measure
    ablation: Measure | None = None  # plain DDP + a separate per-step (loss, stop) all-reduce
    et_first: bool = True


def spread(values: list[float]) -> str:
    """``median [min, q1, q3, max]`` of per-pair figures (quartiles from 4 values up)."""
    v = sorted(values)
    if len(v) >= 4:
        q1, _, q3 = statistics.quantiles(v, n=4)
        return f"{statistics.median(v):.3f} [min {v[0]:.3f}, q1 {q1:.3f}, q3 {q3:.3f}, max {v[-1]:.3f}]"
    return f"{statistics.median(v):.3f} [min {v[0]:.3f}, max {v[-1]:.3f}]"


def _table(rows: list[Round]) -> str:
    abl = all(r.ablation is not None for r in rows)
    cols = ["round", "order", "dropout", "elastictrain", "plain DDP"] + (["plain+AR"] if abl else []) + [
        "ratio", "et med-step", "plain med-step", "ratio(med)", "et wall s", "plain wall s", "load"]
    widths = [max(7, len(c)) for c in cols]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    head = line(cols)
    out = [head, "-" * len(head)]
    for r in rows:
        cells = [str(r.index), "et,pl" if r.et_first else "pl,et", f"{r.dropout:g}", f"{r.et.samples_per_s:.1f}",
                 f"{r.plain.samples_per_s:.1f}"] + ([f"{r.ablation.samples_per_s:.1f}"] if abl else []) + [
            f"{r.et.samples_per_s / r.plain.samples_per_s:.3f}", f"{r.et.robust_samples_per_s:.1f}",
            f"{r.plain.robust_samples_per_s:.1f}", f"{r.et.robust_samples_per_s / r.plain.robust_samples_per_s:.3f}",
            f"{r.et.wall_s:.1f}", f"{r.plain.wall_s:.1f}", f"{max(r.et.load, r.plain.load):.1f}"]
        notes = [r.et.note] if r.et.note else []
        if r.et.cpu is not None and r.et.cpu.standby > STANDBY_STARTING:
            notes.append(f"standby starting in the window: {r.et.cpu.standby * 1e3:.1f} CPU-ms/step; raise --warmup")
        out.append(line(cells) + (f"  [{'; '.join(notes)}]" if notes else ""))
    out.append("")
    for dropout in sorted({r.dropout for r in rows}, reverse=True):
        rs = [r for r in rows if r.dropout == dropout]
        ratios = [r.et.samples_per_s / r.plain.samples_per_s for r in rs]
        typical = [r.et.robust_samples_per_s / r.plain.robust_samples_per_s for r in rs]
        verdict = "meets" if statistics.median(ratios) >= TARGET_RATIO else "BELOW"
        out.append(f"dropout={dropout:g}, {len(rs)} pairs: elastictrain/plain, median of the pairs' ratios = "
                   f"{spread(ratios)}: {verdict} the target {TARGET_RATIO}; typical step (G / median step "
                   f"interval) = {spread(typical)}"
                   + (f"; plain+AR/plain = {spread([r.ablation.samples_per_s / r.plain.samples_per_s for r in rs])}"
                      if abl else ""))
    return "\n".join(out)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _cpu_table(rows: list[Round], note: str | None) -> str:
    """CPU-ms per step by side and role (medians over the pairs), and the training processes' wake-ups."""
    rows = [r for r in rows if r.et.cpu is not None and r.plain.cpu is not None]
    if not rows:
        return ""
    med = statistics.median
    out = ["CPU-ms per step over the steady-state window, median over the pairs (whole side: cgroup; roles: /proc)"
           + (f"\n  note: {note}" if note else "")]
    out.append(f"  {'dropout':>7}  {'side':<13} {'whole':>7} {'training':>9} {'launcher':>9} {'standby':>8} {'ray wkrs':>9} "
               f"{'daemons':>8} {'rest':>7} {'beside':>7} {'wake-ups/s':>11} {'wake-ups/step':>14}")
    for dropout in sorted({r.dropout for r in rows}, reverse=True):
        rs = [r for r in rows if r.dropout == dropout]
        for name, sides in (("elastictrain", [r.et.cpu for r in rs]), ("plain DDP", [r.plain.cpu for r in rs])):
            def m(key: str) -> float | None:
                vals = [getattr(c, key) for c in sides]
                return None if any(v is None for v in vals) else med(vals)
            per_step = med(c.training_wakeups / c.steps_per_s for c in sides)
            out.append(f"  {dropout:>7g}  {name:<13} {_ms(m('whole')):>7} {_ms(m('training')):>9} "
                       f"{_ms(m('launcher')):>9} {_ms(m('standby')):>8} {_ms(m('ray_workers')):>9} {_ms(m('ray_daemons')):>8} "
                       f"{_ms(m('rest')):>7} {_ms(m('background')):>7} {m('training_wakeups'):>11.0f} "
                       f"{per_step:>14.1f}")
    out.append("  whole = the side's cgroup; training = its two ranks; launcher = elastictrain's driver (this "
               "script, less the sampler) / torchrun's agent; standby = elastictrain's standby process; ray wkrs "
               "= other Ray worker processes (Ray's idle pre-started ones); daemons = Ray's; rest = whole less those; wake-ups = "
               "voluntary context switches of a training process, all its threads; beside = the other side's group meanwhile (this "
               "script, idle: no Ray runs during plain DDP's rounds)")
    out.append("\nwake-ups per second per thread of a training process (median over the pairs, threads >= 1/s)")
    for name, sides in (("elastictrain", [r.et.cpu for r in rows]), ("plain DDP", [r.plain.cpu for r in rows])):
        labels = {k for c in sides for k in c.wakeups}
        vals = {k: med(c.wakeups.get(k, 0.0) for c in sides) for k in labels}
        shown = ", ".join(f"{k} {v:.0f}" for k, v in sorted(vals.items(), key=lambda kv: -kv[1]) if v >= 1)
        out.append(f"  {name:<13} {shown}")
    out.append("\nCPU-ms per step per thread of a training process (median over the pairs, threads >= 0.02 ms/step)")
    for name, sides in (("elastictrain", [r.et.cpu for r in rows]), ("plain DDP", [r.plain.cpu for r in rows])):
        labels = {k for c in sides for k in c.thread_cpu}
        vals = {k: med(c.thread_cpu.get(k, 0.0) for c in sides) for k in labels}
        shown = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(vals.items(), key=lambda kv: -kv[1]) if v >= 2e-5)
        out.append(f"  {name:<13} {shown}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description="elastictrain vs plain torchrun DDP: steady-state samples/s")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=8,
                   help="pairs per dropout value; each runs both sides, the first side alternating")
    p.add_argument("--warmup", type=int, default=300,
                   help="steps skipped before the steady-state window (both sides): past the run's start-up, "
                        "the standby's start included")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--ablation", action="store_true",
                   help="also run plain DDP plus a separate per-step (loss, stop) all-reduce each round")
    p.add_argument("--dropouts", default="0.1,0", help="comma-separated model dropout values, one row set each")
    p.add_argument("--no-cpu", action="store_true", help="leave out the CPU figures (no sampler, no cgroups)")
    p.add_argument("--no-standby", action="store_true",
                   help="ablation, not the default: elastictrain with workers.standby false (the standby's share)")
    p.add_argument("--only", choices=("elastictrain", "plain"),
                   help="run one side only and print each run's CPU figures (a before/after of one side's CPU)")
    a = p.parse_args()
    dropouts = [float(x) for x in a.dropouts.split(",") if x.strip()]
    if a.steps <= a.warmup + 1 or a.warmup < 1 or a.rounds < 1:
        p.error("need --rounds >= 1, --warmup >= 1 and --steps > --warmup + 1")
    if a.only and a.no_cpu:
        p.error("--only prints CPU figures: drop --no-cpu")

    import ray

    groups: dict[str, CpuGroup] | None = None
    cg_note = None if a.no_cpu else cgroup_unavailable()
    if not a.no_cpu:
        groups = {}
        if cg_note is None:  # before Ray starts: its daemons and workers are this process's descendants
            groups = {"elastictrain": CpuGroup(), "plain": CpuGroup()}
            groups["elastictrain"].join(os.getpid())
    # Each elastictrain run starts its own private Ray (Trainer's start, as `elastictrain run`: the daemon
    # settings of elastictrain/local_ray.py, worker output forwarded to the driver) and stops it after, so
    # plain DDP runs with no Ray beside it, as it would for a user; Ray's start is in the run's wall time,
    # not in its steps. Same priority for both sides' training processes: Ray starts its worker processes at nice 15 (its
    # RAY_worker_niceness default), torchrun's ranks run at nice 0. Left as is, Ray's own daemons and the
    # driver (nice 0) would preempt elastictrain's workers but not plain DDP's ranks.
    os.environ["RAY_worker_niceness"] = "0"
    print(f"steps={a.steps} warmup={a.warmup} global_batch={a.global_batch} micro_batch={a.micro_batch} "
          f"seq_len={MODEL['seq_len']} world={WORLD} threads/worker=1 cores={os.cpu_count()} "
          f"load avg={os.getloadavg()[0]:.2f}" + (f"\nnote: {cg_note}" if cg_note else ""), flush=True)
    rows: list[Round] = []
    shape = (a.steps, a.global_batch, a.micro_batch, a.warmup)
    try:
        for i in range(1, a.rounds + 1):
            for dropout in dropouts:
                et_first = i % 2 == 1  # AB, BA, AB, ...: drift within a pair favours each side equally often
                if a.only:
                    m = (run_elastictrain(*shape, dropout, cpu=groups, standby=not a.no_standby)
                         if a.only == "elastictrain" else run_plain(*shape, dropout, cpu=groups))
                    print(f"round {i} dropout={dropout:g}: {a.only} {m.samples_per_s:.1f} samples/s, "
                          + one_line(m.cpu), flush=True)
                    continue
                got: dict[str, Measure] = {}
                for side in (("et", "plain") if et_first else ("plain", "et")):
                    if side == "et":
                        got[side] = run_elastictrain(*shape, dropout, cpu=groups, standby=not a.no_standby)
                    else:
                        got[side] = run_plain(*shape, dropout, cpu=groups)
                    print(f"round {i} dropout={dropout:g}: {'elastictrain' if side == 'et' else 'plain DDP   '} "
                          f"{got[side].samples_per_s:.1f} samples/s", flush=True)
                ab = None
                if a.ablation:
                    ab = run_plain(*shape, dropout, stats_allreduce=True)
                    print(f"round {i} dropout={dropout:g}: plain + AR   {ab.samples_per_s:.1f} samples/s", flush=True)
                rows.append(Round(i, dropout, got["et"], got["plain"], ab, et_first))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for g in (groups or {}).values():
            g.close()
    print(f"\nload avg at the end={os.getloadavg()[0]:.2f}\n")
    if a.only:
        return 0
    print(_table(rows))
    if groups is not None:
        print("\n" + _cpu_table(rows, cg_note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
