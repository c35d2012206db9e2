"""The checks the expert-parallel step-loop harnesses share (tests/test_ep_fsdp.py, test_ep_cp.py,
test_ep_hsdp.py): a layout's whole parameters against one process's after each step, and a sharded
checkpoint loaded by name into one process's model."""

from __future__ import annotations

import torch

from tests.test_expert_parallel import ATOL, RTOL


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state with every DTensor gathered whole (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def step_and_match(opts: list, models: dict[str, torch.nn.Module], ref: torch.nn.Module, step: int) -> None:
    """Step every optimizer, then each layout's gathered parameters (``models``: name -> model) must be the
    one-process model ``ref``'s after the same step."""
    for opt in opts:
        opt.step()
        opt.zero_grad()
    whole = {n: gathered(m) for n, m in models.items()}
    for k, v in ref.state_dict().items():
        for n in models:
            torch.testing.assert_close(whole[n][k], v, atol=ATOL, rtol=RTOL,
                                       msg=lambda m, s=step, n=n, k=k: f"{n} step {s} {k}: {m}")


def assert_loads_into_one_process(ckpt: str, fresh: dict[str, torch.Tensor], ref: torch.nn.Module) -> None:
    """The DCP checkpoint at ``ckpt`` loaded by name, without a process group, into ``fresh`` (one process's
    state dict of other values: all overwritten) gives ``ref``'s state."""
    import torch.distributed.checkpoint as dcp

    dcp.load(fresh, checkpoint_id=ckpt, no_dist=True)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(fresh[k], v, atol=ATOL, rtol=RTOL, msg=lambda m, k=k: f"{k} loaded: {m}")
