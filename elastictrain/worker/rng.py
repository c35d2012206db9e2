"""Global randomness as a pure function of (seed, step, micro-batch chunk).

Before each micro-batch's forward the loop reseeds torch's global generators (CPU and, once initialized,
every CUDA device) from ``(train.seed, step, chunk)``. Micro-batch ``k`` of rank ``r`` in a world of ``W``
covers the global positions ``[s*G + (k*W + r)*m, +m)``, so the chunk index ``j = k*W + r`` names the same
samples at any world size: a user model with plain ``nn.Dropout`` (or any other use of the global generator
inside the forward/backward) draws the same numbers for the same samples whether 1 or 8 workers run the
step, and a replacement worker draws what the worker it replaces would have drawn (strict mode stays
bitwise). The per-sample ``sample_seeds`` passed to ``loss_fn`` remain the finer tool (independent of
``micro_batch``).
"""

from __future__ import annotations

import numpy as np
import torch

_DOMAIN = 0x6C0BA1_5EED  # tells these seeds from the per-sample seeds built from the same inputs
_MASK63 = (1 << 63) - 1


def micro_batch_seed(seed: int, step: int, chunk: int) -> int:
    """A 63-bit seed, a pure function of (seed, 0-based step, global chunk index ``k*W + r``)."""
    state = np.random.SeedSequence([_DOMAIN, int(seed), int(step), int(chunk)]).generate_state(2, np.uint64)
    return int((int(state[0]) << 32 ^ int(state[1])) & _MASK63)


def seed_micro_batch(seed: int, step: int, chunk: int) -> None:
    """Reseed torch's global generators for one micro-batch (call right before its forward): the CPU one,
    and every CUDA device's once CUDA is initialized (a GPU worker initializes it at setup).

    Not ``torch.manual_seed``: in a process that has not initialized CUDA (or XPU, MTIA) it queues a
    lazy seed call per backend with a formatted stack trace each time, a visible share of a tiny-GPT step
    (docs/perf/2026-11-23-code-figures.md)."""
    value = micro_batch_seed(seed, step, chunk)
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(value)
