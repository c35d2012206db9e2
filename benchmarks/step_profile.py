"""A CPU-clock profile of elastictrain's worker step, and its CPU seconds per step, at world size 2.

Run: ``python benchmarks/step_profile.py [--steps N] [--warmup W] [--dropout D] [--top K]``

Two real ``Worker`` objects (worker/actor.py) in two processes join one gloo group the way the controller
has them join (``Worker.join``: the generation's groups, the layout, the step runner's attach) and run
``benchmarks/throughput.py``'s job through ``Worker._run_steps``: the step loop with everything a worker does
per step (step records, the after-step hooks, fault points, phases, the step-stats hook, the memory reading).
No Ray and no controller: what this measures is the step path itself; the controller's polls and the Ray
worker's own threads are in ``benchmarks/step_cpu.py``'s per-thread figures.

Rank 0 runs its ``N`` measured steps under ``cProfile`` with ``time.process_time`` as the clock (CPU, not
wall: the machine may be shared) and prints the functions with the most CPU of their own and in total. Both
ranks report ``time.process_time()`` per step over the same steps without the profiler too (a second pass),
so the profiler's own overhead stays out of the per-step figure.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from step_cpu import step_parser  # noqa: E402
from throughput import WORLD, _job  # noqa: E402


def _worker(rank: int, port: int, a: argparse.Namespace, out: str) -> None:
    import torch

    from elastictrain import build_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.actor import Worker
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    total = a.warmup + 2 * a.steps
    config = build_config(_job(total, a.global_batch, a.micro_batch, a.dropout), source="benchmarks/step_profile.py")
    w = Worker(config, builtin_task(config), slot=rank)
    w.runner = StepRunner(w.task, config.train, FaultInjector([]), parallel=config.parallel)
    w.join(0, rank, WORLD, "127.0.0.1", port)
    w._run_steps(a.warmup)
    c0 = time.process_time()
    w._run_steps(a.warmup + a.steps)  # plain pass: CPU per step without the profiler
    plain = (time.process_time() - c0) / a.steps
    w._records.clear()
    prof = cProfile.Profile(time.process_time)
    if rank == 0:
        prof.enable()
    w._run_steps(total)
    if rank == 0:
        prof.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("tottime").print_stats(a.top)
        stats.sort_stats("cumulative").print_stats(a.top)
        for name in a.callers:
            stats.print_callers(name)
        Path(out, "profile.txt").write_text(buf.getvalue())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"cpu_s_per_step": plain}))
    w._leave_group()


def main() -> int:
    p = step_parser("cProfile (CPU clock) of elastictrain's worker step at world 2", warmup=30)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--callers", action="append", default=[], metavar="REGEX",
                   help="also print who calls the functions matching REGEX (pstats.print_callers)")
    a = p.parse_args()

    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    from tests.checkpoint_fixtures import free_port

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the generation's store
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="et-prof-") as out:
        procs = [ctx.Process(target=_worker, args=(r, port, a, out)) for r in range(WORLD)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs):
            raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
        for r in range(WORLD):
            got = json.loads(Path(out, f"rank{r}.json").read_text())
            print(f"rank {r}: {got['cpu_s_per_step'] * 1e3:.2f} ms CPU per step (process_time, no profiler)")
        print(Path(out, "profile.txt").read_text())
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
