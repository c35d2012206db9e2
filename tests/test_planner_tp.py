"""The planner's DTensor op counts (:data:`elastictrain.planner.steptime.TP_BLOCK_OPS`) are the built-in GPT's:
counted here with a dispatch mode on the real model under its real tensor-parallel plan (a one-rank gloo
group in the test's own process, as ``tests/parallel_fixtures.InProcessRun`` makes one), so a change in
torch's DTensor or in the plan that moves them fails this test instead of the estimates. So are the
Partial gradients' counts (:data:`~elastictrain.planner.steptime.TP_PARTIAL_GRADS`), and the parameter
tensors FSDP2's hooks visit (:data:`~elastictrain.planner.steptime.PARAM_TENSORS_PER_BLOCK`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastictrain.planner.steptime import TP_BLOCK_OPS, TP_EDGE_OPS, TP_PARTIAL_GRADS


def _task(layers: int, kind: str = "tiny_gpt") -> dict[str, Any]:
    """The ``task`` section of a built-in model of ``layers`` blocks, 8 wide (the Llama with 2 query heads on 1
    kv head)."""
    if kind == "llama":
        return {"kind": "llama", "model": {"seq_len": 16},
                "llama": {"n_layers": layers, "dim": 8, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 16}}
    return {"model": {"seq_len": 16, "n_layer": layers, "n_head": 2, "d_model": 8, "dropout": 0.0}}


def _each_tp_gpt(measure: Callable[..., Any], kind: str = "tiny_gpt") -> dict[str, Any]:
    """``measure(model, forward)`` for the built-in GPT (or ``kind``'s model) of 1 and 2 blocks under its
    tensor-parallel plan, with and without sequence parallel, keyed ``"{sp}-{blocks}"``: ``forward()`` returns
    one micro-batch's loss (under ``loss_parallel``), whose ``backward()`` the measure calls."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel

    from elastictrain import build_config
    from elastictrain.parallel.tensor import local_loss, parallelize_tp
    from elastictrain.task import builtin_task

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("tp",))
        out = {}
        for sp in (True, False):
            for layers in (1, 2):
                cfg = build_config({
                    "task": _task(layers, kind),
                    "train": {"global_batch": 2, "micro_batch": 2}, "workers": {"min": 1, "max": 1},
                    "parallel": {"plan": "ddp"}})
                task = builtin_task(cfg)
                plan = type("Plan", (), {"sequence_parallel": sp})  # parallel.tp is 1 here: the config refuses sp
                model = parallelize_tp(task.model_fn(), mesh, plan)
                tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
                batch, seeds = {"input": tokens[:, :-1], "target": tokens[:, 1:]}, torch.arange(2)

                def forward(model=model, task=task, batch=batch, seeds=seeds) -> Any:
                    return local_loss(task.loss_fn(model, batch, seeds)).sum()

                with loss_parallel():
                    out[f"{sp}-{layers}"] = measure(model, forward)
        return out
    finally:
        dist.destroy_process_group()


def _count_ops(kind: str = "tiny_gpt") -> dict[str, tuple[int, int]]:
    """(forward, backward) DTensor ops of the second micro-batch, by sequence parallel and block count."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                Count.ops += 1
            return func(*args, **(kwargs or {}))

    def measure(model: Any, forward: Callable[[], Any]) -> tuple[int, int]:
        counts = []
        for _ in range(2):  # the second micro-batch accumulates into the first one's gradients
            Count.ops = 0
            with Count():
                loss = forward()
            fwd, Count.ops = Count.ops, 0
            with Count():
                loss.backward()
            counts.append((fwd, Count.ops))
        return counts[1]

    return _each_tp_gpt(measure, kind)


def test_the_dtensor_op_counts_are_the_builtin_gpts():
    counts = _count_ops()
    for sp in (True, False):
        (f1, b1), (f2, b2) = counts[f"{sp}-1"], counts[f"{sp}-2"]
        assert (f2 - f1, b2 - b1) == TP_BLOCK_OPS[sp]  # one more block
        assert f1 + b1 - sum(TP_BLOCK_OPS[sp]) == TP_EDGE_OPS[sp]  # around the blocks


def _count_partial_grads(kind: str = "tiny_gpt") -> dict[str, int]:
    """Parameters whose gradient comes out of backward Partial over tp (an all-reduce to settle), by
    sequence parallel and block count, on the built-in GPT under its tensor-parallel plan."""
    from torch.distributed.tensor import DTensor

    def measure(model: Any, forward: Callable[[], Any]) -> int:
        forward().backward()
        return sum(1 for p in model.parameters() if isinstance(p.grad, DTensor)
                   and any(q.is_partial() for q in p.grad.placements)
                   and not any(q.is_partial() for q in p.placements))

    return _each_tp_gpt(measure, kind)


def test_the_partial_gradient_counts_are_the_builtin_gpts():
    """Under sequence parallel the norms' gradients are partial sums over tp (FSDP2 over the TP model
    all-reduces each, per micro-batch); without it none are."""
    counts = _count_partial_grads()
    for sp in (True, False):
        per_block, edge = TP_PARTIAL_GRADS[sp]
        assert counts[f"{sp}-2"] - counts[f"{sp}-1"] == per_block
        assert counts[f"{sp}-1"] - per_block == edge


def test_the_parameter_tensor_counts_are_the_builtin_gpts():
    """FSDP2 visits each parameter tensor per micro-batch (:func:`~elastictrain.planner.steptime.fsdp_param_visits`):
    16 per block, 2 on the first stage (the embeddings), 3 on the last (the final norm and the head)."""
    from elastictrain import build_config
    from elastictrain.planner.steptime import PARAM_TENSORS_FIRST, PARAM_TENSORS_LAST, PARAM_TENSORS_PER_BLOCK
    from elastictrain.task import builtin_task

    def tensors(layers: int) -> dict[str, int]:
        cfg = build_config({"task": {"model": {"seq_len": 8, "n_layer": layers, "n_head": 1, "d_model": 8}},
                            "train": {"steps": 1, "global_batch": 1, "micro_batch": 1},
                            "workers": {"min": 1, "max": 1}})
        names = [n for n, _ in builtin_task(cfg).model_fn().named_parameters()]
        return {"blocks": sum(n.startswith("blocks.") for n in names), "edge": sum(not n.startswith("blocks.")
                                                                                  for n in names),
                "first": sum(n.startswith(("tok_emb", "pos_emb")) for n in names)}

    one, two = tensors(1), tensors(2)
    assert two["blocks"] - one["blocks"] == one["blocks"] == PARAM_TENSORS_PER_BLOCK
    assert one["first"] == PARAM_TENSORS_FIRST and one["edge"] == PARAM_TENSORS_FIRST + PARAM_TENSORS_LAST


def test_the_dtensor_op_and_partial_gradient_counts_are_the_builtin_llamas():
    """The same counts for the built-in Llama (``ModelShape.arch == "llama"``)."""
    from elastictrain.planner.steptime import LLAMA_TP_BLOCK_OPS, LLAMA_TP_EDGE_OPS, LLAMA_TP_PARTIAL_GRADS

    ops, partial = _count_ops("llama"), _count_partial_grads("llama")
    for sp in (True, False):
        (f1, b1), (f2, b2) = ops[f"{sp}-1"], ops[f"{sp}-2"]
        assert (f2 - f1, b2 - b1) == LLAMA_TP_BLOCK_OPS[sp]
        assert f1 + b1 - sum(LLAMA_TP_BLOCK_OPS[sp]) == LLAMA_TP_EDGE_OPS[sp]
        per_block, edge = LLAMA_TP_PARTIAL_GRADS[sp]
        assert partial[f"{sp}-2"] - partial[f"{sp}-1"] == per_block and partial[f"{sp}-1"] - per_block == edge


def test_the_parameter_tensor_counts_are_the_builtin_llamas():
    from elastictrain import build_config
    from elastictrain.planner.job import model_shape
    from elastictrain.planner.steptime import param_tensors
    from elastictrain.task import builtin_task

    for tied in (False, True):
        cfg = build_config({"task": {**_task(3, "llama"), "llama": {**_task(3, "llama")["llama"],
                                                                    "tie_embeddings": tied}}})
        names = [n for n, _ in builtin_task(cfg).model_fn().named_parameters()]
        per_block, first, last = param_tensors(model_shape(cfg))
        assert sum(n.startswith("layers.") for n in names) == 3 * per_block
        assert names[0] == "tok_embeddings.weight" and first == 1
        assert len(names) == 3 * per_block + first + last
