"""The speed options (issue 38): ``parallel.compile``, ``parallel.float8``, selective recomputation, MFU in
step events, ``train.profile``.

Compile tolerance: a compiled block runs the same math as the eager one, but inductor fuses the elementwise
ops and may sum in another order, so each fp32 result can differ by a few units of the last place (2^-24
relative); through a few hundred ops and three AdamW steps that stays below 1e-5 relative (the band
tests/test_tensor_parallel.py uses for tensor parallelism's reordered sums). A real defect is far larger:
the first steps lower the loss by 0.5-2.5% each, so a block left out of the gradient, a stale compiled graph
or a lost update leaves the band by the next step."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any

import pytest
import torch
from torch import nn

from elastictrain.config import ConfigError, build_config
from tests.conftest import job
from tests.ranks import run_world

COMPILE_LOSS_RTOL = 1e-5
MODEL = {"seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 16, "dropout": 0.0}


def _spec(world: int, steps: int = 3, **parallel: Any) -> dict[str, Any]:
    return job(task={"model": MODEL}, train={"steps": steps, "global_batch": 8, "micro_batch": 2},
               workers={"min": world, "max": world}, parallel=parallel)


# ------------------------------------------------------------------------------------------- config rules


def test_config_refuses_what_cannot_run_naming_why():
    with pytest.raises(ConfigError, match=r"parallel.compile=true with task.model.dropout=0.1.*graph break"):
        build_config({"parallel": {"compile": True}})
    assert build_config({"parallel": {"compile": True}, "task": {"model": {"dropout": 0}}}).parallel.compile
    # the tensor-parallel Llama compiles (its embedding's output collective is synchronous: models/gpt_tp.py)
    assert build_config({"parallel": {"compile": True, "tp": 2}, "task": {"kind": "llama"},
                         "workers": {"min": 2, "max": 2}}).parallel.compile
    with pytest.raises(ConfigError, match=r"parallel.float8=true needs CUDA GPUs.*workers.use_gpu=false"):
        build_config({"parallel": {"float8": True, "plan": "fsdp"}})
    with pytest.raises(ConfigError, match=r"parallel.float8=true with parallel.tp=2"):
        build_config({"parallel": {"float8": True, "tp": 2}, "workers": {"use_gpu": True, "min": 2, "max": 2}})
    modes = {v: build_config({"parallel": {"activation_checkpointing": v}}).parallel.ac_mode
             for v in (False, True, "full", "selective")}
    assert modes == {False: "none", True: "full", "full": "full", "selective": "selective"}
    with pytest.raises(ConfigError, match="train.profile"):
        build_config({"train": {"profile": {"steps": [0]}}})


def test_float8_is_refused_on_cpu_in_one_line_and_filters_small_layers_and_the_head():
    from elastictrain.parallel.speed import float8_filter, float8_unavailable

    why = float8_unavailable(torch.device("cpu"))
    assert why and "\n" not in why and "parallel.float8=false" in why
    assert float8_filter(nn.Linear(2048, 8192), "layers.0.feed_forward.w1")
    assert not float8_filter(nn.Linear(2048, 512), "layers.0.attention.wk")  # small: casts cost more
    assert not float8_filter(nn.Linear(2048, 2056), "layers.0.x")  # 2056 is no multiple of 16
    assert not float8_filter(nn.Linear(2048, 128256), "output") and not float8_filter(nn.Linear(2048, 4096), "head")
    assert not float8_filter(nn.LayerNorm(2048), "norm")


def test_compile_on_cpu_without_a_cxx_compiler_is_refused_naming_the_fix(monkeypatch):
    from elastictrain.parallel.speed import compile_unavailable

    assert compile_unavailable(torch.device("cpu")) is None  # g++ is here
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    why = compile_unavailable(torch.device("cpu"))
    assert why and "C++ compiler" in why and "parallel.compile=false" in why and "\n" not in why


# ------------------------------------------------------------------------------------------ the planner


def test_selective_recomputation_is_priced_between_none_and_full():
    from elastictrain.planner import GIB, Candidate, Cluster, ModelShape, Training, memory, step_time

    model = ModelShape(layers=32, hidden=4096, heads=32, seq_len=8192, vocab=128256, ffn_mult=3.5,
                       params=8_000_000_000)
    node = Cluster(nodes=1, devices_per_node=8, device_memory=80 * GIB, flops=400e12, intra_node_bw=450e9,
                   inter_node_bw=50e9)
    train = Training(global_batch=16, micro_batch=1, precision="mixed", activation_bytes=2)
    for base in (Candidate(dp_shard=8), Candidate(dp_shard=2, tp=4), Candidate(dp_shard=4, pp=2)):
        none, full, sel = (dataclasses.replace(base, activation_checkpointing=ac) for ac in (False, True, "selective"))
        acts = [memory(model, train, node, c).activations for c in (none, sel, full)]
        assert acts[0] > acts[1] > acts[2], (base, acts)
        totals = [memory(model, train, node, c).total for c in (none, sel, full)]
        assert totals[0] > totals[1] > totals[2], (base, totals)
        # no matmul is recomputed: compute as without checkpointing, below full recomputation's
        times = [step_time(model, train, node, c).compute_s for c in (none, sel, full)]
        assert times[0] == pytest.approx(times[1]) and times[1] < times[2]
    assert "sac" in Candidate(activation_checkpointing="selective").describe()


# ------------------------------------------------------------------------------------------ MFU


def test_flops_per_token_is_6n_plus_attention_from_the_model():
    from elastictrain.flops import flops_per_token, mfu, model_flops_per_token, peak_flops_of
    from elastictrain.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(seq_len=32, n_layer=3, d_model=16))
    d = 16  # per block: q, k, v, attn_out (d x d) and the MLP (2 x 4 d x d); the head (256 x d)
    n = 3 * (4 * d * d + 8 * d * d) + 256 * d
    assert model_flops_per_token(model, 32) == flops_per_token(n, 3, d, 32) == 6 * n + 12 * 3 * d * 32
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops_of("some CPU") is None
    assert mfu(1e9, 100.0, 2, 1e12) == pytest.approx(0.05) and mfu(None, 100.0, 2, 1e12) is None


def test_step_events_carry_tokens_per_second_and_mfu_and_compile_time(tmp_path):
    from elastictrain.controller.ledger import Ledger
    from elastictrain.events import EventLog
    from elastictrain.worker.loop import StepRecord

    log = EventLog(tmp_path, console=None)
    ledger = Ledger(log, total_steps=3, global_batch=4, max_workers=2, cpu_peak_flops=1e10)
    ledger.new_generation(0, 2, 1)

    def record(step: int, step_s: float, compile_s: float | None = None) -> StepRecord:
        return StepRecord(step=step, loss=1.0, world_size=2, accum=1, step_s=step_s, compute_s=step_s,
                          finished_at=float(step), tokens=4 * 64, flops_per_token=1e6, devices=2,
                          compile_s=compile_s)

    first = ledger.add(0, record(1, 5.0, compile_s=5.0), complete=True)[0]
    second = ledger.add(0, record(2, 0.5), complete=True)[0]
    assert first["compile_s"] == 5.0 and "compile_s" not in second
    assert second["tokens_per_s"] == pytest.approx(512.0) and second["tokens_per_s_per_device"] == pytest.approx(256.0)
    assert second["mfu"] == pytest.approx(1e6 * 512 / (2 * 1e10))
    summary = ledger.summary("finished", {})
    assert summary["mfu"] == pytest.approx(second["mfu"])  # the compiling step stays out of the median
    assert summary["goodput"]["compile_s"] == 5.0 and summary["goodput"]["productive_s"] == 0.5
    log.close()


# --------------------------------------------------------------------------- recomputation, one process


def _op_counts(ac: Any) -> dict[str, int]:
    """aten ops run by one forward + backward of a 2-block GPT under ``activation_checkpointing=ac``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from elastictrain.config import ParallelConfig
    from elastictrain.models.gpt import GPT, GPTConfig
    from elastictrain.parallel.parallelize import parallelize

    counts: dict[str, int] = {"mm": 0, "layer_norm": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("mm", "addmm"):
                counts["mm"] += 1
            elif name == "native_layer_norm":
                counts["layer_norm"] += 1
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = parallelize(GPT(GPTConfig(seq_len=8, n_layer=2, d_model=16, dropout=0.0)),
                            init_device_mesh("cpu", (1,)), ParallelConfig(activation_checkpointing=ac)).module
        with Count():
            model(torch.randint(0, 256, (2, 8))).mean().backward()
    finally:
        dist.destroy_process_group()
    return counts


def test_selective_recomputation_reruns_the_norms_but_no_matmul():
    none, full, sel = _op_counts(False), _op_counts("full"), _op_counts("selective")
    assert sel["mm"] == none["mm"] < full["mm"]  # matmul outputs kept (full recomputes 6 per block)
    assert sel["layer_norm"] == full["layer_norm"] > none["layer_norm"]  # the rest recomputed


# ----------------------------------------------------------------------------- real processes (gloo)


def _train(rank: int, world: int, layouts: list[dict[str, Any]], port: int, out: str) -> None:
    """One rank: each layout in turn on one gloo group (StepRunner after attach, seeded init, 3 steps);
    rank 0 saves each run's losses, compile_s per step and the gathered whole model."""
    import torch.distributed as dist

    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # no pool of compile workers on a 2-core machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    results = []
    try:
        for parallel in layouts:
            cfg = build_config(_spec(world, **parallel))
            task = dataclasses.replace(builtin_task(cfg), lr_fn=None)
            runner = StepRunner(task, cfg.train, FaultInjector(()), parallel=cfg.parallel)
            runner.attach(rank, world, 0, resolve(spec_from_config(cfg), world))
            if runner.uninitialized:
                runner.init_from_seed()
            records = [runner.run_step(False)[0] for _ in range(cfg.train.steps)]
            results.append({"losses": [r.loss for r in records], "compile_s": [r.compile_s for r in records],
                            "params": runner.state.full_model_state()})
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _run(tmp_path, world: int, layouts: list) -> list:
    return run_world(_train, tmp_path, world, layouts)


def test_selective_and_full_recomputation_change_no_number_under_fsdp2(tmp_path):
    """Recomputed ops run the same kernels on the same inputs: every loss and the final model are bitwise
    those of the run without checkpointing."""
    none, full, sel = _run(tmp_path, 2, [{"plan": "fsdp"}, {"plan": "fsdp", "activation_checkpointing": "full"},
                                         {"plan": "fsdp", "activation_checkpointing": "selective"}])
    assert none["losses"] == full["losses"] == sel["losses"] and len(none["losses"]) == 3
    for name, t in none["params"].items():
        assert torch.equal(sel["params"][name], t) and torch.equal(full["params"][name], t), name


@pytest.mark.slow  # inductor's first compile of a block costs 5-20 s of CPU per process (C++ builds)
def test_compiled_blocks_train_like_eager_under_ddp2_and_fsdp2(tmp_path):
    runs = _run(tmp_path, 2, [{"plan": "ddp"}, {"plan": "ddp", "compile": True}, {"plan": "fsdp", "compile": True,
                                                                                  "activation_checkpointing": True}])
    eager = runs[0]
    for run in runs[1:]:
        for step, (a, b) in enumerate(zip(run["losses"], eager["losses"], strict=True), 1):
            assert abs(a - b) <= COMPILE_LOSS_RTOL * abs(b), (step, a, b)
        for name, t in eager["params"].items():
            assert torch.allclose(run["params"][name], t, rtol=0, atol=1e-5), name
        assert run["compile_s"][0] is not None and run["compile_s"][1:] == [None, None]  # the first step only
    assert eager["compile_s"] == [None, None, None]


# ------------------------------------------------------------------------------------------- profiles


def _profiled_losses(tmp_path, profile: dict[str, Any] | None) -> tuple[list[float], list[dict[str, Any]]]:
    import torch.distributed as dist

    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    spec = _spec(1)
    spec["train"]["profile"] = profile
    cfg = build_config(spec)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runner = StepRunner(builtin_task(cfg), cfg.train, FaultInjector(()), parallel=cfg.parallel)
        runner.attach(0, 1, 0, resolve(spec_from_config(cfg), 1))
        losses = [runner.run_step(False)[0].loss for _ in range(cfg.train.steps)]
        return losses, runner.profiler.take()
    finally:
        dist.destroy_process_group()


def test_a_profiled_step_has_the_numbers_of_an_unprofiled_one_and_its_trace_parses(tmp_path):
    from elastictrain.controller.ledger import Ledger
    from elastictrain.events import EventLog, read_events

    plain, none = _profiled_losses(tmp_path, None)
    profiled, taken = _profiled_losses(tmp_path, {"steps": [2], "ranks": [0], "memory": True})
    assert profiled == plain and none == []
    assert [(t["rank"], t["step"], sorted(t["files"])) for t in taken] == [(0, 2, ["step2_rank0.json"])]
    log = EventLog(tmp_path, console=None)
    Ledger(log, 3, 8, 1).save_profile(taken[0])
    log.close()
    trace = json.loads((tmp_path / "profiles" / "step2_rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)  # the step's matmuls are in it
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])  # memory: true on CPU
    saved = [e for e in read_events(tmp_path) if e["event"] == "profile_saved"]
    assert saved and saved[0]["files"] == ["profiles/step2_rank0.json"]


def test_a_run_reports_throughput_and_mfu_and_lands_every_ranks_profile(tmp_path, ray_local):
    """The whole path on Ray: workers profile step 2 on both ranks, the traces reach RUN_DIR/profiles/ and
    the summary; step events carry tokens/s and MFU (the calibration's FLOP/s: a CPU job's peak)."""
    from tests.conftest import run_job

    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"flops": 1e10}))
    spec = _spec(2, steps=3, plan="ddp", calibration=str(calibration))
    spec["train"]["profile"] = {"steps": [2], "ranks": [0, 1]}
    run = run_job(tmp_path, spec)
    assert run.result.exit_code == 0, [e.get("reason") for e in run.of("failure") + run.of("run_failed")]
    steps = run.of("step")
    tokens = 8 * MODEL["seq_len"]
    for e in steps:
        assert e["tokens_per_s"] == pytest.approx(tokens / e["step_s"], rel=1e-3)
        assert e["mfu"] == pytest.approx(e["tokens_per_s"] * _gpt_flops_per_token() / (2 * 1e10), rel=1e-3)
    saved = sorted((e["rank"], e["step"], tuple(e["files"])) for e in run.of("profile_saved"))
    assert saved == [(0, 2, ("profiles/step2_rank0.json",)), (1, 2, ("profiles/step2_rank1.json",))]
    for _, _, (path,) in saved:
        assert json.loads((run.dir / path).read_text())["traceEvents"]
    assert run.summary["mfu"] is not None and len(run.summary["profiles"]) == 2


def _gpt_flops_per_token() -> float:
    from elastictrain.flops import model_flops_per_token
    from elastictrain.models.gpt import GPT, GPTConfig

    m = MODEL
    return model_flops_per_token(GPT(GPTConfig(seq_len=m["seq_len"], n_layer=m["n_layer"], n_head=m["n_head"],
                                               d_model=m["d_model"])), m["seq_len"])


def test_the_gpu_benchmark_path_runs_on_cpu_without_ray(tmp_path):
    """benchmarks/models.py --gpu runs one process with no Ray on the GPU machine: its code path, dry-run on
    the CPU (gloo, tiny sizes, eager only: compile is the slow test's), imports no ray and writes its table."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "benchmarks/models.py", "--gpu", "--device", "cpu", "--variants", "eager",
                           "--steps", "2"], cwd=root, env={**os.environ, "OUT": str(tmp_path)}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ray imported: False" in done.stdout
    table = json.loads((tmp_path / "models_gpu.json").read_text())
    assert not table["ray_imported"] and {(r["model"], r["variant"]) for r in table["rows"]} == {
        ("llama", "eager"), ("gpt", "eager")}
    assert all(len(r["losses"]) == 2 and r["tokens_per_s"] > 0 for r in table["rows"])
