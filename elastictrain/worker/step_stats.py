"""The per-step (loss sum, stop flag) word, carried inside DDP's last gradient bucket.

Every step needs the global loss and whether any rank asked to stop, agreed by all ranks before the
optimizer step. A separate all-reduce for those two numbers costs one collective latency per step; here a
DDP communication hook (``torch.distributed.algorithms.ddp_comm_hooks`` contract: ``hook(state, bucket) ->
Future[Tensor]``) appends the word to the bucket DDP reduces last and splits it off the result, so the
step has no collective of its own. Other buckets go through the stock ``allreduce_hook`` (divide by the
world size, then sum), and the carried bucket does the same to its gradient part.

The word rides only when the gradients are float32/float64 (a bf16 or fp16 bucket would round the loss);
otherwise, and without DDP (e.g. a sharded layout), :meth:`StepStats.send` issues the separate async
all-reduce as before. Either way ``send(word).wait()`` returns the summed word after the last backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

_CARRY_DTYPES = (torch.float32, torch.float64)


class _Sent:
    """Handle of one step's word: ``wait()`` returns it summed over the ranks."""

    def __init__(self, stats: "StepStats | None", work: Any = None, word: torch.Tensor | None = None) -> None:
        self._stats, self._work, self._word = stats, work, word

    @property
    def carried(self) -> bool:
        """True when the word rides in the last gradient bucket (no collective of its own)."""
        return self._work is None

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            return self._word
        result, self._stats.result = self._stats.result, None
        if result is None:
            raise RuntimeError("the last gradient bucket did not carry the step word (no synchronised backward "
                               "ran after send)")
        return result


class StepStats:
    """Owns the comm hook of one DDP module. ``send(word)`` before the last (synchronised) backward."""

    def __init__(self, ddp: Any = None) -> None:
        self.result: torch.Tensor | None = None
        self._word: torch.Tensor | None = None
        self._carry = ddp is not None and _all_params_carry(ddp)
        if self._carry:
            try:
                # the hook's state is the group it reduces over: DDP's own (under cp, the dp x cp ranks), not
                # the world (None), which would average over ranks that hold other shards or samples
                ddp.register_comm_hook(ddp.process_group, self._hook)
            except RuntimeError:  # the user's parallelize_fn registered its own hook: keep it, send apart
                self._carry = False

    @property
    def carries(self) -> bool:
        """True when the comm hook is installed and :meth:`send` rides in the last bucket."""
        return self._carry

    def send(self, word: torch.Tensor) -> _Sent:
        """Sum ``word`` (float64) over the group, riding in the last gradient bucket when possible."""
        if not self._carry:
            word = word.clone()
            return _Sent(None, dist.all_reduce(word, async_op=True), word)
        self._word, self.result = word, None
        return _Sent(self)

    def _hook(self, group, bucket):  # noqa: ANN001, ANN202 - DDP checks these annotations; strings fail it
        """DDP comm hook: ``(state, bucket: GradBucket) -> Future[Tensor]``."""
        word = self._word
        if word is None or not bucket.is_last():
            return default_hooks.allreduce_hook(group, bucket)
        self._word = None
        buf = bucket.buffer()
        size = (group if group is not None else dist.group.WORLD).size()
        n = buf.numel()
        combined = torch.cat([buf.div_(size), word.to(device=buf.device, dtype=buf.dtype)])

        def split(fut: torch.futures.Future) -> torch.Tensor:
            out = fut.value()[0]
            self.result = out[n:].to(device="cpu", dtype=torch.float64)
            buf.copy_(out[:n])
            return buf

        return dist.all_reduce(combined, group=group, async_op=True).get_future().then(split)


def _all_params_carry(ddp: Any) -> bool:
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    return bool(params) and all(p.dtype in _CARRY_DTYPES for p in params)
