"""Optimizer steps and gradient clipping on DTensor parameters' local shards (elastictrain/parallel/optim.py):
a step bitwise the same as torch's own DTensor step, a fresh optimizer's state prepared the same way torch
prepares it, clipping to torch's norm. Real gloo groups in real processes, real FSDP2 ``fully_shard`` over 4
ranks (odd sizes: uneven shards, empty ones) and HSDP on a 2x2 mesh.

Clipping tolerance: both sides compute the same global 2-norm from the same fp32 values, adding squares in
another order (torch: per-gradient norms, then the norm of those; here: per-rank sums of squares, then a
sum over ranks): a few ulps apart, relative 1e-6 allowed; a missing or doubled shard moves it by >= 10%."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from elastictrain.parallel import optim
from tests.checkpoint_fixtures import free_port
from tests.ranks import run_ranks

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
}


def _model(mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # dim-0 sizes 7 and 2 over 4 ranks: shards of 2/2/2/1 rows and 1/1/0/0
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": m, "optim": o}  # full on rank 0, empty elsewhere


def _equal(a: dict, b: dict) -> bool:
    from torch.utils._pytree import tree_flatten_with_path

    fa, fb = (dict(tree_flatten_with_path(t)[0]) for t in (a, b))
    # only rank 0's results are kept, and rank 0 holds the full state: empty is no agreement
    return bool(fa) and fa.keys() == fb.keys() and all(
        torch.equal(fa[k], fb[k]) and fa[k].dtype == fb[k].dtype if isinstance(fa[k], torch.Tensor) else fa[k] == fb[k]
        for k in fa)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    try:
        for name, make in OPTIMIZERS.items():
            ours, theirs = _model(mesh), _model(mesh)
            o_ours, o_theirs = make(ours.parameters()), make(theirs.parameters())
            assert optim.on_shards(o_ours)
            for step in range(3):
                torch.manual_seed(100 + step)  # the same batch on every rank and both models
                x = torch.randn(4, 6)
                for model, opt, local in ((ours, o_ours, True), (theirs, o_theirs, False)):
                    model(x).pow(2).sum().backward()
                    optim.step(opt) if local else opt.step()
                    opt.zero_grad(set_to_none=True)
            state_is_dtensor = all(isinstance(v, DTensor) for st in o_ours.state.values() for v in st.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0)
            results[f"step {name}"] = _equal(_full(ours, o_ours), _full(theirs, o_theirs)) and state_is_dtensor

            # a fresh optimizer's state: ours on the shards, torch's by its DTensor step; parameters unchanged
            ours, theirs = _model(mesh), _model(mesh)
            o_ours, o_theirs = make(ours.parameters()), make(theirs.parameters())
            before = {k: v.full_tensor() for k, v in ours.state_dict().items()}
            fresh = not o_ours.state  # Adagrad makes its state in its constructor: nothing to prepare
            made = optim.init_state(o_ours) == fresh
            _init_optim_state(o_theirs)
            after = {k: v.full_tensor() for k, v in ours.state_dict().items()}
            unchanged = all(torch.equal(before[k], after[k]) for k in before)
            no_grads = all(p.grad is None for p in ours.parameters())
            results[f"init {name}"] = (made and unchanged and no_grads and not optim.init_state(o_ours)
                                       and _equal(_full(ours, o_ours), _full(theirs, o_theirs)))

        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        for layout, m in (("fsdp", mesh), ("hsdp", hsdp)):
            for max_norm in (0.05, 1e6):  # clipping, and a bound the norm stays under (grads unchanged)
                ours, theirs = _model(m), _model(m)
                torch.manual_seed(7 + rank)  # another batch per rank: gradients differ before reduction
                x = torch.randn(4, 6)
                for model in (ours, theirs):
                    model(x).pow(2).sum().backward()
                n_ours = optim.clip_grad_norm(ours.parameters(), max_norm)
                n_theirs = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, foreach=False).full_tensor()
                g_ours = [p.grad.full_tensor() for p in ours.parameters()]
                g_theirs = [p.grad.full_tensor() for p in theirs.parameters()]
                close = bool(torch.isclose(n_ours, n_theirs, rtol=1e-6, atol=0)) and all(
                    torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(g_ours, g_theirs))
                clipped = (n_theirs > max_norm) == (max_norm < 1)
                results[f"clip {layout} {max_norm}"] = close and bool(clipped)

        model = _model(mesh)
        results["subclass falls back"] = not optim.on_shards(type("MyAdamW", (torch.optim.AdamW,), {})(model.parameters()))
        results["adafactor falls back"] = not optim.on_shards(torch.optim.Adafactor(model.parameters()))
        results["plain falls back"] = not optim.on_shards(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
        if rank == 0:
            torch.save(results, Path(out, "results.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("optim")
    run_ranks(_worker, (4, free_port(), str(out)), 4)
    return torch.load(out / "results.pt")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_step_on_local_shards_is_bitwise_the_dtensor_step(results, name):
    assert results[f"step {name}"], f"{name}: parameters or state differ from torch's DTensor step"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fresh_state_is_torchs_preparation_and_leaves_parameters_alone(results, name):
    assert results[f"init {name}"]


@pytest.mark.parametrize("case", ["subclass falls back", "adafactor falls back", "plain falls back"])
def test_other_optimizers_step_on_dtensors_as_they_are(results, case):
    assert results[case]


@pytest.mark.parametrize("case", ["fsdp 0.05", "fsdp 1000000.0", "hsdp 0.05", "hsdp 1000000.0"])
def test_clipping_on_local_shards_matches_torchs_dtensor_clipping(results, case):
    assert results[f"clip {case}"], f"{case}: norm or clipped gradients differ from torch's"
