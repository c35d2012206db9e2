"""The built-in task's cross-entropy, eager against compiled (``parallel.compile`` compiles it:
:func:`elastictrain.parallel.speed.compiled_per_sample_loss`), on the CPU. Not a timed test.

For each shape (tokens x vocabulary) it reports, for the loss's forward and backward on fp32 logits:

- ``saved_mib``: what autograd keeps for the backward (``torch.autograd.graph.saved_tensors_hooks``: the
  distinct storages saved, MiB; the logits themselves excluded, as the head keeps them anyway): a count,
  not a clock;
- ``cpu_ms``: process CPU time (user + system) per forward + backward, the median of ``--repeats`` runs of
  ``--iters`` each (CPU time, not wall clock: less sensitive to other processes on the cores, not immune);
- ``max_rel_diff``: the compiled per-sample losses' and logit gradients' largest difference from eager's,
  relative to eager's largest magnitude;
- ``compile_cpu_s``: the CPU seconds of the compiled loss's first call (compiling, inductor's caches cold
  only on a machine where they are).

    python benchmarks/compiled_loss.py [--shapes 128x256,512x32768] [--iters 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

import torch


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _saved_bytes(fn: Any, logits: torch.Tensor, targets: torch.Tensor) -> int:
    seen: dict[int, int] = {}
    skip = logits.untyped_storage().data_ptr()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr != skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(logits, targets)
    loss.sum().backward()
    logits.grad = None
    return sum(seen.values())


def measure(n: int, v: int, iters: int, repeats: int) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from elastictrain.models.gpt import per_sample_loss
    from elastictrain.parallel.speed import compiled_per_sample_loss

    torch.manual_seed(0)
    b = 4 if n % 4 == 0 else 1
    logits = torch.randn(b, n // b, v).mul_(3).requires_grad_()
    targets = torch.randint(0, v, (b, n // b))
    compiled = compiled_per_sample_loss()
    c0 = _cpu()
    compiled(logits, targets).sum().backward()
    compile_cpu_s = _cpu() - c0
    out: dict[str, Any] = {"tokens": n, "vocab": v, "compile_cpu_s": round(compile_cpu_s, 2)}
    results = {}
    for name, fn in (("eager", per_sample_loss), ("compiled", compiled)):
        logits.grad = None
        loss = fn(logits, targets)
        loss.sum().backward()
        results[name] = (loss.detach(), logits.grad.clone())
        logits.grad = None
        out[f"{name}_saved_mib"] = round(_saved_bytes(fn, logits, targets) / 2**20, 3)
        runs = []
        for _ in range(repeats):
            c0 = _cpu()
            for _ in range(iters):
                fn(logits, targets).sum().backward()
                logits.grad = None
            runs.append((_cpu() - c0) / iters * 1e3)
        out[f"{name}_cpu_ms"] = round(statistics.median(runs), 3)
    for i, what in enumerate(("loss", "grad")):
        e, c = results["eager"][i], results["compiled"][i]
        out[f"max_rel_diff_{what}"] = float((c - e).abs().max() / e.abs().max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="128x256,512x32768")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    for shape in args.shapes.split(","):
        n, v = (int(x) for x in shape.split("x"))
        print(json.dumps(measure(n, v, args.iters, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
