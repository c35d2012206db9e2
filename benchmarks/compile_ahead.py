"""What a standby's compile ahead saves the replacement that takes it (``parallel.compile``), in CPU seconds
and cache counts rather than wall clock. Not a timed test.

Each case runs in a fresh process (the tiny GPT of the test suite, dropout 0, world size 1 over gloo, the
worker's ``StepRunner``), with its own inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``):

- ``eager``: ``parallel.compile`` off: the first step's cost without compiling, for reference;
- ``cold``: no compile ahead, an empty cache: what a replacement paid before (compiled in its first step);
- ``ahead``: :meth:`StepRunner.compile_ahead` first (what the standby's set-up ahead runs, timed apart), then
  the take: ``attach`` and the first step on the model compiled ahead;
- ``disk``: no compile ahead, in a new process whose cache directory ``cold`` filled: a cold replacement on
  the node of an earlier compile (inductor's on-disk FX graph and AOTAutograd caches);

each under ``ddp`` and ``fsdp``. Per case: ``ahead_cpu_s`` (the standby's compile ahead), ``take_cpu_s``
(attach + first step: the replacement's part, this process and its compiler children, user + system),
``first_step_s`` (the first step's wall time, the ``compile_s`` a step event carries), ``later_step_cpu_s``
(the mean of two more steps), and the compile counters of the take (dynamo frames compiled, FX graph and
AOTAutograd cache hits and misses). ::

    python benchmarks/compile_ahead.py [--plans ddp,fsdp] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = {"seq_len": 32, "n_layer": 2, "n_head": 2, "d_model": 32, "dropout": 0.0}


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"frames": counters["stats"]["unique_graphs"],
            "fx_hit": counters["inductor"]["fxgraph_cache_hit"], "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_miss": counters["aot_autograd"]["autograd_cache_miss"]}


def run_case(plan: str, compile_: bool, ahead: bool) -> dict[str, Any]:
    """One case in this process (see the module doc)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from elastictrain.config import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    cfg = build_config({"name": "bench", "task": {"model": MODEL},
                        "train": {"steps": 3, "seed": 0, "global_batch": 8, "micro_batch": 4},
                        "workers": {"min": 1, "max": 1, "standby": False},
                        "parallel": {"plan": plan, "compile": compile_}})
    task = dataclasses.replace(builtin_task(cfg), lr_fn=None)
    runner = StepRunner(task, cfg.train, FaultInjector(()), parallel=cfg.parallel)
    out: dict[str, Any] = {"plan": plan, "compile": compile_, "ahead": ahead}
    c0 = _cpu()
    out["ahead_ran"] = runner.compile_ahead() if ahead else False
    out["ahead_cpu_s"] = round(_cpu() - c0, 3)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before, c0 = _counts(), _cpu()
        runner.attach(0, 1, 0, resolve(spec_from_config(cfg), 1))
        if runner.uninitialized:
            runner.init_from_seed()
        t0 = time.perf_counter()
        first = runner.run_step(False)[0]
        out["first_step_s"] = round(time.perf_counter() - t0, 3)
        out["take_cpu_s"] = round(_cpu() - c0, 3)
        out["take_counts"] = {k: v - before[k] for k, v in _counts().items()}
        c1 = _cpu()
        losses = [first.loss] + [runner.run_step(False)[0].loss for _ in range(2)]
        out["later_step_cpu_s"] = round((_cpu() - c1) / 2, 4)
        out["losses"] = losses
    finally:
        dist.destroy_process_group()
    return out


def _child(plan: str, compile_: bool, ahead: bool, cache: str) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "MASTER_ADDR": "127.0.0.1"}
    arg = json.dumps({"plan": plan, "compile": compile_, "ahead": ahead})
    done = subprocess.run([sys.executable, __file__, "--case", arg], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--plans", default="ddp,fsdp")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(**{("compile_" if k == "compile" else k): v
                                     for k, v in json.loads(args.case).items()})))
        return
    rows = []
    for plan in args.plans.split(","):
        with tempfile.TemporaryDirectory() as cold, tempfile.TemporaryDirectory() as fresh:
            for name, compile_, ahead, cache in (("eager", False, False, fresh), ("cold", True, False, cold),
                                                 ("ahead", True, True, tempfile.mkdtemp(dir=fresh)),
                                                 ("disk", True, False, cold)):
                row = {"case": name, **_child(plan, compile_, ahead, cache)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
