"""Steady-state training throughput: elastictrain DDP vs a hand-written torchrun DDP script.

Run: ``python benchmarks/throughput.py [--steps N] [--rounds R] [--warmup W]``

Both sides train the built-in tiny GPT with the same global batch, micro batch, step count, optimizer,
grad clip, LR schedule, dataset and one intra-op thread per worker, on 2 CPU workers. Rounds alternate
(elastictrain, plain, elastictrain, plain, ...) in one process, so slow drift of the machine hits both.

* elastictrain: ``Trainer(...).fit()`` on a local Ray started once by this script and reused by every
  round. Throughput comes from the ``step`` events of ``events.jsonl``.
* plain: ``benchmarks/plain_ddp.py`` under ``python -m torch.distributed.run --nproc_per_node=2``; rank 0
  records ``time.time()`` after each optimizer step.

Steady state (both sides, same function): skip the first W steps, then
``(N - W) * global_batch / (t[N] - t[W])`` where ``t[s]`` is the time of step ``s``.

For elastictrain, ``t[s]`` is the ``time`` field of the step event, as the brief defines it. That is the
controller's clock when it *observed* the step (it polls workers every ~0.2 s), so both ends of the window
are late by up to one poll interval. The table also shows the worker-clock figure: the step event's
``samples_per_s`` is ``G / (finished_at[s] - finished_at[s-1])`` on rank 0, so summing ``G / samples_per_s``
over the window gives rank 0's own elapsed time, measured exactly like the plain script measures its.

Honesty note: elastictrain all-reduces (loss, stop flag) every step; the plain script does not (a user logs
rank 0's local loss). That extra collective is part of what is measured.
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
    samples_per_s: float          # steady-state figure as defined in the module docstring
    worker_clock_samples_per_s: float | None = None  # elastictrain only: rank 0's clock
    wall_s: float = 0.0           # whole run, start-up included (for information)
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


# ------------------------------------------------------------------------------------------ elastictrain


def _job(steps: int, global_batch: int, micro_batch: int) -> dict[str, Any]:
    opt = {k: OPTIM[k] for k in ("lr", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip")}
    return {
        "name": "throughput",
        "task": {"kind": "tiny_gpt", "model": dict(MODEL), "data": {"source": "builtin:pydoc"}, "optimizer": opt},
        "train": {"steps": steps, "seed": SEED, "global_batch": global_batch, "micro_batch": micro_batch,
                  "log_every": steps},
        "workers": {"min": WORLD, "max": WORLD, "cpus_per_worker": 1.0},
        "checkpoint": {"uri": None, "every_steps": 0, "resume": "never"},
    }


def run_elastictrain(steps: int, global_batch: int, micro_batch: int, warmup: int) -> Measure:
    from elastictrain import Trainer, build_config

    config = build_config(_job(steps, global_batch, micro_batch), source="benchmarks/throughput.py")
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
    times = [e["time"] for e in steps_ev]
    # Rank 0's clock: finished_at[s] - finished_at[s-1] = G / samples_per_s (see module docstring).
    worker_times, t = [], 0.0
    for e in steps_ev:
        t += global_batch / e["samples_per_s"]
        worker_times.append(t)
    return Measure(steady_state(times, warmup, global_batch),
                   steady_state(worker_times, warmup, global_batch), wall, note)


# ------------------------------------------------------------------------------------------ plain DDP


def run_plain(steps: int, global_batch: int, micro_batch: int, warmup: int) -> Measure:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
           "--master_port", "0", str(PLAIN_SCRIPT), "--steps", str(steps), "--global-batch", str(global_batch),
           "--micro-batch", str(micro_batch), "--seed", str(SEED)]
    for key, value in MODEL.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    for key, value in OPTIM.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
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
    return Measure(steady_state(out["times"], warmup, global_batch), None, wall)


# ------------------------------------------------------------------------------------------ report


def _table(rows: list[tuple[int, Measure, Measure]]) -> str:
    head = (f"{'round':>5}  {'elastictrain':>12}  {'(worker clk)':>12}  {'plain DDP':>10}  "
            f"{'ratio':>6}  {'ratio(wclk)':>11}  {'et wall s':>9}  {'plain wall s':>12}")
    lines = [head, "-" * len(head)]
    for i, et, pl in rows:
        lines.append(f"{i:>5}  {et.samples_per_s:>12.1f}  {et.worker_clock_samples_per_s:>12.1f}  "
                     f"{pl.samples_per_s:>10.1f}  {et.samples_per_s / pl.samples_per_s:>6.3f}  "
                     f"{et.worker_clock_samples_per_s / pl.samples_per_s:>11.3f}  {et.wall_s:>9.1f}  "
                     f"{pl.wall_s:>12.1f}" + (f"  [{et.note}]" if et.note else ""))
    et_med = statistics.median(r[1].samples_per_s for r in rows)
    wc_med = statistics.median(r[1].worker_clock_samples_per_s for r in rows)
    pl_med = statistics.median(r[2].samples_per_s for r in rows)
    lines.append("-" * len(head))
    lines.append(f"{'med':>5}  {et_med:>12.1f}  {wc_med:>12.1f}  {pl_med:>10.1f}  {et_med / pl_med:>6.3f}  "
                 f"{wc_med / pl_med:>11.3f}")
    verdict = "meets" if et_med / pl_med >= TARGET_RATIO else "BELOW"
    lines.append(f"\nratio of medians elastictrain/plain = {et_med / pl_med:.3f} ({verdict} target "
                 f"{TARGET_RATIO}); worker-clock ratio = {wc_med / pl_med:.3f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description="elastictrain vs plain torchrun DDP: steady-state samples/s")
    p.add_argument("--steps", type=int, default=240, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs elastictrain then plain DDP")
    p.add_argument("--warmup", type=int, default=30, help="steps skipped before the steady-state window")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    a = p.parse_args()
    if a.steps <= a.warmup + 1 or a.warmup < 1 or a.rounds < 1:
        p.error("need --rounds >= 1, --warmup >= 1 and --steps > --warmup + 1")

    import ray

    # Started once and reused: Trainer only initialises Ray when it is not yet initialised. Ray's
    # daemons stay up during the plain rounds too, so both sides share the same background load.
    ray.init(num_cpus=WORLD, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    print(f"steps={a.steps} warmup={a.warmup} global_batch={a.global_batch} micro_batch={a.micro_batch} "
          f"seq_len={MODEL['seq_len']} world=2 threads/worker=1 cores={os.cpu_count()}", flush=True)
    rows = []
    try:
        for i in range(1, a.rounds + 1):
            et = run_elastictrain(a.steps, a.global_batch, a.micro_batch, a.warmup)
            print(f"round {i}: elastictrain {et.samples_per_s:.1f} samples/s "
                  f"(worker clock {et.worker_clock_samples_per_s:.1f})", flush=True)
            pl = run_plain(a.steps, a.global_batch, a.micro_batch, a.warmup)
            print(f"round {i}: plain DDP    {pl.samples_per_s:.1f} samples/s", flush=True)
            rows.append((i, et, pl))
    finally:
        ray.shutdown()
    print()
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
