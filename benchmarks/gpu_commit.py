"""The single-rank NCCL checks of issue 36 (items 5 and 1) on one CUDA GPU, without Ray.

Builds the step loop (``StepRunner``) on a 1-rank ``cpu:gloo,cuda:nccl`` group and checks, step by step:

1. a step commits after the device sync (``_commit_gate``) and its record carries the memory fields on
   CUDA (``host_mib``, ``alloc_mib``, ``reserved_mib``);
2. the generation's abort flag set between the word and the optimizer (fault ``abort`` at point
   ``commit``): the step raises ``StepAborted`` and the parameters and the optimizer state are unchanged;
3. a ``nan`` fault: the update is skipped (``record.skipped``), parameters unchanged, the step counted;
4. a real NCCL abort (``_abort_process_group``) at the commit point: the step is discarded, the
   parameters unchanged;
and times ``memory_peak.read_and_reset`` (the per-step reading) on this machine.

Run: ``python benchmarks/gpu_commit.py [--plan ddp|fsdp] [--out DIR]``. Prints one JSON object; exit 1 if a
check failed, 2 without CUDA. The two-rank NCCL paths (a live rank's device sync ended by an abort after its
peer died) need two GPUs and are not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elastictrain.config import build_config  # noqa: E402
from elastictrain.parallel.layout import resolve, spec_from_config  # noqa: E402
from elastictrain.task import builtin_task  # noqa: E402
from elastictrain.worker import memory_peak  # noqa: E402
from elastictrain.worker.faults import FaultInjector  # noqa: E402
from elastictrain.worker.loop import StepAborted, StepRunner  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(runner: StepRunner) -> dict[str, torch.Tensor]:
    """Local parameters and optimizer tensors, cloned (what a commit would change)."""
    out = {f"p:{n}": (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
           for n, p in runner.model.named_parameters()}
    for i, st in enumerate(runner.optimizer.state.values()):
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"o:{i}:{k}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="ddp", choices=["ddp", "fsdp"])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--cpu", action="store_true", help="a dry run of the script on gloo (no NCCL check)")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 2
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    faults = [{"rank": 0, "step": 2, "point": "commit", "kind": "abort", "generation": None},
              {"rank": 0, "step": 3, "kind": "nan", "generation": None}]
    config = build_config({"workers": {"min": 1, "max": 1, "use_gpu": True}, "parallel": {"plan": args.plan},
                           "train": {"steps": 10, "global_batch": 8, "micro_batch": 4}, "faults": faults})
    device = torch.device("cpu" if args.cpu else "cuda:0")
    if not args.cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.cpu else "cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    layout = resolve(spec_from_config(config), 1)
    runner = StepRunner(builtin_task(config), config.train, FaultInjector(config.faults),
                        parallel=config.parallel, device=device)
    runner.attach(0, 1, 0, layout)
    if runner.uninitialized:
        runner.init_from_seed()
    checks: dict[str, Any] = {"plan": args.plan, "device": "cpu" if args.cpu else torch.cuda.get_device_name(device),
                              "torch": torch.__version__}

    # 1. a step commits after the device sync; the memory fields are filled on CUDA
    before = _state(runner)
    record, _ = runner.run_step(False)
    mem = record.memory or {}
    checks["1_commit"] = {"ok": runner.step == 1 and not _same(before, _state(runner)) and record.skipped is None,
                          "loss": record.loss}
    kinds = ("host_mib",) if args.cpu else ("host_mib", "alloc_mib", "reserved_mib")
    checks["1_memory"] = {"ok": all(mem.get(k, 0) > 0 for k in kinds) and mem["host_mib"] > 50, **mem}

    # 2. the abort flag between the word and the optimizer: nothing written, the step not counted
    before = _state(runner)
    try:
        runner.run_step(False)
        raised = None
    except StepAborted as e:
        raised = str(e)
        runner.discard_partial_step()
    checks["2_abort_flag"] = {"ok": raised is not None and runner.step == 1 and _same(before, _state(runner)),
                              "raised": raised}
    runner.aborted.clear()  # what the next generation's attach does (a sharded one would also rebuild the state)

    # the step the abort discarded, again: commits
    record, _ = runner.run_step(False)
    checks["2_redo"] = {"ok": record.skipped is None and runner.step == record.step, "step": record.step}

    # 3. a nan fault: the update skipped, the step counted
    before = _state(runner)
    nan_step = runner.step + 1
    if nan_step != 3:  # the fault is addressed to step 3
        checks["3_nan"] = {"ok": False, "why": f"at step {nan_step}, the nan fault is at step 3"}
    else:
        record, _ = runner.run_step(False)
        checks["3_nan"] = {"ok": record.skipped is not None and runner.step == 3 and _same(before, _state(runner)),
                           "skipped": record.skipped}
    record, _ = runner.run_step(False)
    checks["3_after"] = {"ok": record.skipped is None and record.loss == record.loss, "loss": record.loss}

    # cost of the per-step memory reading
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        memory_peak.read_and_reset(device)
    checks["memory_read_us"] = round((time.perf_counter() - t0) / n * 1e6, 2)
    checks["host_reset_works"] = memory_peak.host_reset_works()

    # 4. a real NCCL abort at the commit point: the step is discarded, nothing written
    runner.faults = FaultInjector(build_config({"faults": [
        {"rank": 0, "step": runner.step + 1, "point": "commit", "kind": "abort", "generation": None}]}).faults)

    def real_abort() -> None:
        runner.abort()
        if not args.cpu:
            dist.distributed_c10d._abort_process_group()

    runner.faults.bind(abort=real_abort, stall=runner._stall)
    before, step_before = _state(runner), runner.step
    try:
        runner.run_step(False)
        raised = None
    except Exception as e:  # noqa: BLE001 - StepAborted, or NCCL's own error on the aborted communicator
        raised = f"{type(e).__name__}: {str(e)[:200]}"
    checks["4_nccl_abort"] = {"ok": raised is not None and runner.step == step_before
                              and _same(before, _state(runner)), "raised": raised}

    ok = all(v.get("ok", True) for v in checks.values() if isinstance(v, dict))
    checks["all_ok"] = ok
    text = json.dumps(checks, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"gpu_commit_{args.plan}.json").write_text(text)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - aborted above
        pass
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
