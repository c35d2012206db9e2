"""Steady-state training throughput: elastictrain DDP vs a hand-written torchrun DDP script.

Run: ``python benchmarks/throughput.py [--steps N] [--rounds R] [--warmup W] [--dropouts 0.1,0] [--ablation]``

Both sides train the built-in tiny GPT with the same global batch, micro batch, step count, optimizer,
grad clip, LR schedule, dataset and one intra-op thread per worker, on 2 CPU workers. Rounds alternate
(elastictrain, plain, elastictrain, plain, ...) in one process, so slow drift of the machine hits both.
Both sides' training processes run at nice 0 (Ray's workers would otherwise start at nice 15, below Ray's
own daemons and the driver), and neither side checkpoints (durable or peer memory tier).

* elastictrain: ``Trainer(...).fit()`` on a local Ray started once by this script as ``elastictrain run``
  starts its own (``elastictrain/local_ray.py``: system config, daemon settings) and reused by every
  round. Throughput comes from the ``step`` events of ``events.jsonl``.
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

The machine is shared: the ``load`` column is the 1-minute load average after each pair of runs; on 2 cores,
a value well above 2 means other processes took CPU from the workers and the round is noisy.
"""

from __future__ import annotations

import argparse
import json
import logging
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
PLAIN_SCRIPT = HERE / "plain_ddp.py"
RESULT_PREFIX = "PLAIN_DDP_RESULT "
TARGET_RATIO = 0.97

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


def _job(steps: int, global_batch: int, micro_batch: int, dropout: float) -> dict[str, Any]:
    opt = {k: OPTIM[k] for k in ("lr", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip")}
    return {
        "name": "throughput",
        "task": {"kind": "tiny_gpt", "model": {**MODEL, "dropout": dropout}, "data": {"source": "builtin:pydoc"},
                 "optimizer": opt},
        "train": {"steps": steps, "seed": SEED, "global_batch": global_batch, "micro_batch": micro_batch,
                  "log_every": steps},
        "workers": {"min": WORLD, "max": WORLD, "cpus_per_worker": 1.0},
        "checkpoint": {"uri": None, "every_steps": 0, "memory_every_steps": 0, "resume": "never"},
    }


def run_elastictrain(steps: int, global_batch: int, micro_batch: int, warmup: int, dropout: float) -> Measure:
    from elastictrain import Trainer, build_config

    config = build_config(_job(steps, global_batch, micro_batch, dropout), source="benchmarks/throughput.py")
    with tempfile.TemporaryDirectory(prefix="et-bench-") as tmp:
        t0 = time.time()
        result = Trainer(config, run_dir=tmp, console=None).fit()
        wall = time.time() - t0
        events = [json.loads(line) for line in (Path(tmp) / "events.jsonl").read_text().splitlines() if line]
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
    return Measure(steady_state(times, warmup, global_batch), wall,
                   steady_state_robust(times, warmup, global_batch), os.getloadavg()[0], note)


# ------------------------------------------------------------------------------------------ plain DDP


def run_plain(steps: int, global_batch: int, micro_batch: int, warmup: int, dropout: float,
              stats_allreduce: bool = False) -> Measure:
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
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    wall = time.time() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"plain DDP run failed (exit {proc.returncode}):\n{tail}")
    out = json.loads(lines[-1][len(RESULT_PREFIX):])
    if out["world_size"] != WORLD or out["threads"] != 1 or len(out["times"]) != steps:
        raise RuntimeError(f"plain DDP ran an unexpected layout: {({k: v for k, v in out.items() if k != 'times'})}")
    return Measure(steady_state(out["times"], warmup, global_batch), wall,
                   steady_state_robust(out["times"], warmup, global_batch), os.getloadavg()[0])


# ------------------------------------------------------------------------------------------ report


@dataclass(frozen=True)
class Round:
    index: int
    dropout: float
    et: Measure
    plain: Measure
    ablation: Measure | None = None  # plain DDP + a separate per-step (loss, stop) all-reduce


def _table(rows: list[Round]) -> str:
    abl = all(r.ablation is not None for r in rows)
    cols = ["round", "dropout", "elastictrain", "plain DDP"] + (["plain+AR"] if abl else []) + [
        "ratio", "et med-step", "plain med-step", "ratio(med)", "et wall s", "plain wall s", "load"]
    widths = [max(7, len(c)) for c in cols]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    def cells(label: str, dropout: str, et: float, pl: float, ab: float | None, erb: float, prb: float,
              tail: tuple[str, ...]) -> list[str]:
        out = [label, dropout, f"{et:.1f}", f"{pl:.1f}"] + ([f"{ab:.1f}"] if abl else [])
        return out + [f"{et / pl:.3f}", f"{erb:.1f}", f"{prb:.1f}", f"{erb / prb:.3f}", *tail]

    head = line(cols)
    out = [head, "-" * len(head)]
    for r in rows:
        ab = r.ablation.samples_per_s if abl else None
        out.append(line(cells(str(r.index), f"{r.dropout:g}", r.et.samples_per_s, r.plain.samples_per_s, ab,
                              r.et.robust_samples_per_s, r.plain.robust_samples_per_s,
                              (f"{r.et.wall_s:.1f}", f"{r.plain.wall_s:.1f}",
                               f"{max(r.et.load, r.plain.load):.1f}")))
                   + (f"  [{r.et.note}]" if r.et.note else ""))
    med = statistics.median
    out.append("-" * len(head))
    verdicts = []
    for dropout in sorted({r.dropout for r in rows}, reverse=True):
        rs = [r for r in rows if r.dropout == dropout]
        et_m, pl_m = med(r.et.samples_per_s for r in rs), med(r.plain.samples_per_s for r in rs)
        ab_m = med(r.ablation.samples_per_s for r in rs) if abl else None
        erb_m, prb_m = med(r.et.robust_samples_per_s for r in rs), med(r.plain.robust_samples_per_s for r in rs)
        out.append(line(cells("median", f"{dropout:g}", et_m, pl_m, ab_m, erb_m, prb_m, ("", "", ""))))
        verdict = "meets" if et_m / pl_m >= TARGET_RATIO else "BELOW"
        verdicts.append(f"dropout={dropout:g}: elastictrain/plain (ratio of medians, rank 0's clock after the "
                        f"optimizer step, both sides) = {et_m / pl_m:.3f}: {verdict} the target {TARGET_RATIO}; "
                        f"typical step (G / median step interval) = {erb_m / prb_m:.3f}"
                        + (f"; plain+AR/plain = {ab_m / pl_m:.3f}" if abl else ""))
    return "\n".join(out + [""] + verdicts)


def main() -> int:
    p = argparse.ArgumentParser(description="elastictrain vs plain torchrun DDP: steady-state samples/s")
    p.add_argument("--steps", type=int, default=240, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs elastictrain then plain DDP")
    p.add_argument("--warmup", type=int, default=30, help="steps skipped before the steady-state window")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--ablation", action="store_true",
                   help="also run plain DDP plus a separate per-step (loss, stop) all-reduce each round")
    p.add_argument("--dropouts", default="0.1,0", help="comma-separated model dropout values, one row set each")
    a = p.parse_args()
    dropouts = [float(x) for x in a.dropouts.split(",") if x.strip()]
    if a.steps <= a.warmup + 1 or a.warmup < 1 or a.rounds < 1:
        p.error("need --rounds >= 1, --warmup >= 1 and --steps > --warmup + 1")

    import ray

    from elastictrain.local_ray import init_local_ray

    # Started once and reused: Trainer only initialises Ray when it is not yet initialised. Ray's daemons
    # stay up during the plain rounds too, so both sides share the same background load.
    # address="local": always a private instance, never a Ray cluster someone else started on this machine.
    # Same priority for both sides' training processes: Ray starts its worker processes at nice 15 (its
    # RAY_worker_niceness default), torchrun's ranks run at nice 0. Left as is, Ray's own daemons and the
    # driver (nice 0) would preempt elastictrain's workers but not plain DDP's ranks.
    # The Ray `elastictrain run` starts (elastictrain/local_ray.py: its system config and daemon settings).
    os.environ["RAY_worker_niceness"] = "0"
    init_local_ray(WORLD, logging_level=logging.WARNING, log_to_driver=False)
    print(f"steps={a.steps} warmup={a.warmup} global_batch={a.global_batch} micro_batch={a.micro_batch} "
          f"seq_len={MODEL['seq_len']} world={WORLD} threads/worker=1 cores={os.cpu_count()} "
          f"load avg={os.getloadavg()[0]:.2f}", flush=True)
    rows: list[Round] = []
    shape = (a.steps, a.global_batch, a.micro_batch, a.warmup)
    try:
        for i in range(1, a.rounds + 1):
            for dropout in dropouts:
                et = run_elastictrain(*shape, dropout)
                print(f"round {i} dropout={dropout:g}: elastictrain {et.samples_per_s:.1f} samples/s", flush=True)
                pl = run_plain(*shape, dropout)
                print(f"round {i} dropout={dropout:g}: plain DDP    {pl.samples_per_s:.1f} samples/s", flush=True)
                ab = None
                if a.ablation:
                    ab = run_plain(*shape, dropout, stats_allreduce=True)
                    print(f"round {i} dropout={dropout:g}: plain + AR   {ab.samples_per_s:.1f} samples/s", flush=True)
                rows.append(Round(i, dropout, et, pl, ab))
    finally:
        ray.shutdown()
    print(f"\nload avg at the end={os.getloadavg()[0]:.2f}\n")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
