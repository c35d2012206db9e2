"""Hugging Face weights in (``task.init_from``) and out (``ckpt export --format hf``) for the built-in Llama,
against ``transformers``' own LlamaForCausalLM, built from a small config with random weights and written
with ``save_pretrained`` (nothing downloaded).

* in one process: our Llama loaded from the directory gives transformers' logits (tied and untied heads,
  with and without Llama 3.1 rope scaling); the written directory's config.json round-trips;
* on real gloo processes through the worker's own step path (StepRunner.attach + init_from_seed + run_step,
  as tests/test_tensor_parallel.py does) under fsdp2, tp2, pp2 and ddp2 (2 ranks), and under hsdp
  (dp_replicate 2 x dp_shard 2), fsdp2 x tp2, pp2 x tp2, pp2 x fsdp2, a tied head (split over pipeline
  stages under pp2 x ddp2, pp2 x fsdp2, pp2 x tp2; sharded under fsdp2 x tp2) and fsdp2 x tp2 from an
  ``s3://`` source on 4 ranks: step 1's loss equals transformers' own mean next-token loss
  over the very samples step 1 took (the sample audit), and every rank asked the reader for exactly the
  slices it holds (its DTensor shards, its stages' tensors), each once;
* the hsdp and pp2 x tp2 runs, trained a second step and checkpointed as the worker does, exported with
  ``ckpt export --format hf``: transformers loads the trained weights and gives our logits on them;
* runs on local Ray, ddp with one worker, through ``Trainer`` (the driver's checks, the replicated sync
  that loads the source): the same; a run branched from its checkpoint after the source was zeroed repeats
  its step (a resume never rereads the source); its checkpoint exported with the CLI and loaded by
  transformers: the trained weights and the same logits as our model gives;
* errors: a wrong-shaped and a missing tensor, an explicit dimension that disagrees with config.json, each a
  config error naming it (exit 2 from ``elastictrain run``, before Ray).

Tolerances (and why): in one process both models run the same fp32 operations in the same order
(embedding, RMSNorm in fp32, the same rotary tables, SDPA, SwiGLU): measured bitwise equal logits; we allow
1e-5 absolute (logits ~ 1) for a different SDPA kernel choice. Across layouts, FSDP/TP/PP compute the same
fp32 math with the sums of a matrix product split over ranks (tp) or the micro-batches' losses summed in
another order: measured within 2.2e-8 relative of transformers' loss (~5.6) under fsdp2 and pp2, equal
under tp2 and ddp2, within 2.2e-8 under each 4-rank product; we allow 1e-5 relative, as
tests/test_tensor_parallel.py does for the same reasons. A loading bug moves them by far more (measured by
breaking the code): the gate and up projections swapped in the name table move the logits by 3.7e-2; the
seeded values kept instead of the source's (init_from_seed not calling the task's init_weights) move step 1's
loss by 1.4e-2 relative in every 2-rank layout, by 1.0e-2 (untied) and 1.4e-3 (tied) in every 4-rank one. A
loader that reads whole tensors and keeps its shard (full_state_dict loads) gives the right loss and fails
the read check; an export with gate and up swapped fails the exported-weights check.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint_fixtures import free_port, s3_bucket, s3_server  # noqa: F401 - fixtures
from tests.conftest import job
from tests.ranks import run_ranks

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LOGIT_ATOL = 1e-5
LOSS_RTOL = 1e-5
SEQ = 32
HF_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256, rope_theta=500000.0, max_position_embeddings=64)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # short: positions past 16 of a 32-token window scale


def save_hf(path: Path, tied: bool = False, scaling: dict | None = None, seed: int = 0) -> Any:
    """A random transformers Llama written with save_pretrained to ``path``; returns the model (eval)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**HF_SHAPE, tie_word_embeddings=tied, rope_scaling=scaling)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(path))
    return model


def hf_loss(model: Any, batch: dict[str, torch.Tensor]) -> float:
    """transformers' mean next-token loss over the batch's samples (each sample's mean, then their mean:
    what a step reports)."""
    from elastictrain.models.gpt import per_sample_loss

    with torch.no_grad():
        return float(per_sample_loss(model(input_ids=batch["input"]).logits, batch["target"]).mean())


def ours_from(path: Path) -> torch.nn.Module:
    from elastictrain.models.hf_llama import llama_kwargs_from_hf
    from elastictrain.models.hf_weights import load_hf_weights, read_source
    from elastictrain.models.llama import Llama, LlamaConfig

    src = read_source(str(path))
    cfg = LlamaConfig(**llama_kwargs_from_hf(src.config))
    model = Llama(cfg)
    load_hf_weights(model, str(path), None, cfg.tie_embeddings)
    return model.eval()


# ------------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("scaling", [None, LLAMA3_ROPE], ids=["rope", "llama3_rope"])
def test_loaded_llama_gives_transformers_logits(tmp_path, tied, scaling):
    hf = save_hf(tmp_path, tied=tied, scaling=scaling)
    ours = ours_from(tmp_path)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    x = torch.randint(0, 256, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours(x), hf(input_ids=x).logits
    assert (got - want).abs().max().item() <= LOGIT_ATOL


def test_config_json_round_trips():
    from elastictrain.models.hf_llama import hf_config_from, llama_kwargs_from_hf
    from elastictrain.models.llama import LlamaConfig

    for scaling in (None, LLAMA3_ROPE):
        hf = transformers.LlamaConfig(**HF_SHAPE, rope_scaling=scaling).to_dict()
        kw = llama_kwargs_from_hf(hf)
        assert kw["rope_theta"] == 500000.0 and (kw["rope_scaling"] is None) == (scaling is None)
        again = llama_kwargs_from_hf(hf_config_from(LlamaConfig(**kw)))
        assert again == kw
    old = {**transformers.LlamaConfig(**HF_SHAPE).to_dict(), "rope_theta": 1e4}  # transformers 4's layout
    old.pop("rope_parameters")
    old["rope_scaling"] = {"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}}
    kw = llama_kwargs_from_hf(old)
    assert kw["rope_theta"] == 1e4 and kw["rope_scaling"]["factor"] == 8.0


def test_export_writes_what_transformers_loads(tmp_path):
    """write_hf (what ``ckpt export --format hf`` calls) from our state: one file, and index-sharded files."""
    from elastictrain.checkpoint.export_hf import write_hf

    save_hf(tmp_path / "src", tied=False, scaling=LLAMA3_ROPE)
    ours = ours_from(tmp_path / "src")
    with torch.no_grad():  # trained weights are not the source's: move every tensor
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ours(x)
    for name, shard_bytes in (("one", 10**9), ("sharded", 64 * 1024)):
        out = tmp_path / name
        out.mkdir()
        n = write_hf(ours.state_dict(), ours.cfg, out, None, "test", shard_bytes=shard_bytes)
        assert n == len(ours.state_dict())
        files = sorted(p.name for p in out.glob("*.safetensors"))
        assert (files == ["model.safetensors"]) == (name == "one"), files
        assert (out / "model.safetensors.index.json").exists() == (name == "sharded")
        back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        with torch.no_grad():
            got = back(input_ids=x).logits
        assert (got - want).abs().max().item() <= LOGIT_ATOL


def test_load_from_s3_by_ranges(tmp_path, s3_server, s3_bucket):
    """An ``s3://`` source (a real moto endpoint), in index-sharded files: the ranged reader gives the
    logits a local load gives, and a slice of rows and columns reads exactly that slice."""
    import s3fs

    from elastictrain.models.hf_weights import _read_slice, load_hf_weights, read_source

    hf = save_hf(tmp_path / "src", scaling=LLAMA3_ROPE)
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    fs = s3fs.S3FileSystem(**s3_server.options())
    fs.put(str(tmp_path / "sharded") + "/", f"{s3_bucket}/llama/", recursive=True)
    uri, opts = f"{s3_bucket}/llama", s3_server.options()
    local = ours_from(tmp_path / "src")
    remote = type(local)(local.cfg)
    load_hf_weights(remote, uri, opts, tied=False)
    for name, t in local.state_dict().items():
        assert torch.equal(t, remote.state_dict()[name]), name
    src = read_source(uri, opts)
    entry = src.tensors["model.layers.0.mlp.down_proj.weight"]  # [64, 128]
    full = hf.state_dict()["model.layers.0.mlp.down_proj.weight"]
    fsx, _ = __import__("fsspec").core.url_to_fs(uri, **opts)
    got = _read_slice(fsx, entry, [10, 64], [20, 32])
    assert torch.equal(got, full[10:30, 64:96])


def test_export_refuses_a_checkpoint_of_another_model():
    from elastictrain.checkpoint.errors import CheckpointError
    from elastictrain.checkpoint.export_hf import llama_of
    from elastictrain.checkpoint.manifest import Manifest

    for task in ({"kind": "tiny_gpt"}, None):
        m = Manifest(step=1, world_size=1, files={}, meta={"fingerprint": {"task": task}}, created_at=0.0,
                     location="/c/step_000000001")
        with pytest.raises(CheckpointError, match="not a checkpoint of the built-in Llama"):
            llama_of(m)


# ------------------------------------------------------------------------------- layouts on gloo processes
def _spec(world: int, source: str, *, options: dict[str, Any] | None = None, **parallel: Any) -> dict[str, Any]:
    return job(task={"kind": "llama", "init_from": source, "init_from_storage_options": options or {},
                     "model": {"seq_len": SEQ}, "optimizer": {"lr": 3e-3, "warmup_steps": 0}},
               train={"steps": 1, "global_batch": 8, "micro_batch": 2, "audit_samples": True},
               workers={"min": world, "max": world}, parallel=parallel)


Run = tuple[str, dict[str, Any], str | None]  # (source, parallel settings, checkpoint root to save into)


def _first_step(rank: int, world: int, runs: list[Run], options: dict[str, dict], port: int, out: str) -> None:
    """One rank: per run the worker's StepRunner (the task as the driver builds it), the initial values
    (init_from_seed: the source's weights, each slice DCP asks for recorded), one step; every rank keeps each
    step's loss and audited samples, the slices it read and the slices it holds. A run with a checkpoint root
    then takes a second step and saves as the worker does (:func:`_save`). ``options``: storage options by
    source (an ``s3://`` one)."""
    import torch.distributed as dist

    from elastictrain.config import build_config
    from elastictrain.models import hf_weights
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    reads: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    make_reader = hf_weights.make_reader

    def recording_reader(*args: Any, **kwargs: Any) -> Any:  # the loader's own reader, its requests noted
        reader = make_reader(*args, **kwargs)
        read_data = reader.read_data

        def read(plan: Any, planner: Any) -> Any:
            reads.extend((r.storage_index.fqn, tuple(r.storage_offsets), tuple(r.lengths)) for r in plan.items)
            return read_data(plan, planner)

        reader.read_data = read
        return reader

    hf_weights.make_reader = recording_reader
    results = []
    try:
        for source, parallel, save_root in runs:
            cfg = build_config(_spec(world, source, options=options.get(source), **parallel))
            runner = StepRunner(builtin_task(cfg), cfg.train, FaultInjector(()), audit=True, parallel=cfg.parallel)
            runner.attach(rank, world, 0, resolve(spec_from_config(cfg), world))
            assert runner.uninitialized  # every layout: no step-0 values until the source is loaded
            reads.clear()
            runner.init_from_seed()
            held = _held_slices(runner.model, runner.task.init_weights.tied)
            record = runner.run_step(False)[0]
            results.append({"layout": parallel, "source": source, "loss": record.loss,
                            "ids": sorted(record.sample_ids), "mesh": runner.mesh, "reads": list(reads),
                            "held": held, "trained": _save(runner, cfg, save_root) if save_root else None})
        torch.save(results, f"{out}.{rank}")
    finally:
        hf_weights.make_reader = make_reader
        dist.destroy_process_group()


def _save(runner: Any, cfg: Any, root: str) -> dict[str, torch.Tensor]:
    """A second step, then the training state saved as the worker saves it (CheckpointWriter on its own
    gloo group) and committed by rank 0 with the driver's fingerprint (which ``ckpt export --format hf``
    reads the shape from). Returns the full values of the tensors this rank holds."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from elastictrain.checkpoint import CheckpointStore, CheckpointWriter
    from elastictrain.checkpoint.compat import driver_fingerprint
    from elastictrain.config import CheckpointConfig

    runner.run_step(False)
    world = dist.get_world_size()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    writer = CheckpointWriter(CheckpointConfig(), root, dist.get_rank(), world, group)
    try:
        writer.save_async(runner.step, runner.state.state_dict(), wait=True)
        reports = writer.wait(60)
    finally:
        writer.close()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, reports)
    if dist.get_rank() == 0:
        meta = {"world_size": world, "fingerprint": driver_fingerprint(cfg, None, builtin_task=True)}
        CheckpointStore(root).commit(runner.step, [r for rs in everyone for r in rs], meta)
    dist.destroy_process_group(group)
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for n, t in runner.model.state_dict().items()}


def _held_slices(model: torch.nn.Module, tied: bool) -> set[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(Hugging Face name, global offsets, lengths) of every tensor slice this rank holds (a DTensor's local
    shard, a plain tensor whole); empty shards are left out (nothing to read)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from elastictrain.models.hf_llama import hf_from_ours

    held = set()
    for name, t in model.state_dict().items():
        hf = "model.embed_tokens.weight" if tied and name.endswith("output.weight") else hf_from_ours(name)
        if isinstance(t, DTensor):
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        else:
            shape, offset = tuple(t.shape), (0,) * t.dim()
        if all(n > 0 for n in shape):
            held.add((hf, tuple(offset), tuple(shape)))
    return held


def _layout_runs(tmp_path: Path, world: int, runs: list[Run], options: dict[str, dict] | None = None
                 ) -> list[list[dict]]:
    """Each rank's results of :func:`_first_step` over ``runs``."""
    out = str(tmp_path / "got.pt")
    run_ranks(_first_step, (world, runs, options or {}, free_port(), out), nprocs=world)
    return [torch.load(f"{out}.{r}") for r in range(world)]


def _check_against_transformers(got: list[list[dict]], models: dict[str, Any], world: int,
                                options: dict[str, dict] | None = None) -> None:
    """Step 1's loss is transformers' on the very samples step 1 took; every rank read exactly the slices it
    holds, each once (never a whole tensor it shards, never a tensor of another stage)."""
    for i, r in enumerate(got[0]):
        batch = _batch(_spec(world, r["source"], options=(options or {}).get(r["source"])), r["ids"])
        want = hf_loss(models[r["source"]], batch)
        assert len(r["ids"]) == 8, r["layout"]
        assert abs(r["loss"] - want) <= LOSS_RTOL * abs(want), (r["source"], r["mesh"], r["loss"], want)
        for rank, ranks in enumerate(got):
            mine = ranks[i]
            assert mine["loss"] == r["loss"] and mine["ids"] == r["ids"], (r["layout"], rank)
            assert len(mine["reads"]) == len(set(mine["reads"])), (r["layout"], rank, "a slice read twice")
            assert set(mine["reads"]) == mine["held"], (r["layout"], rank, set(mine["reads"]) ^ mine["held"])


def _batch(cfg_spec: dict[str, Any], ids: list[int]) -> dict[str, torch.Tensor]:
    from elastictrain.config import build_config
    from elastictrain.task import builtin_task

    data = builtin_task(build_config(cfg_spec)).dataset_fn()
    samples = [data[i] for i in ids]
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def test_first_loss_equals_transformers_under_each_layout(tmp_path):
    hf = save_hf(tmp_path / "src")
    source = str(tmp_path / "src")
    layouts = [{"plan": "fsdp"}, {"tp": 2}, {"pp": 2, "pp_schedule": "gpipe"}, {"plan": "ddp"}]
    got = _layout_runs(tmp_path, 2, [(source, p, None) for p in layouts])
    _check_against_transformers(got, {source: hf}, 2)


# (source directory, parallel settings, name of the checkpoint its step 2 is saved as, or None)
PRODUCTS = [("src", {"plan": "hsdp", "shard_size": 2}, "hsdp"), ("src", {"plan": "fsdp", "tp": 2}, None),
            ("src", {"pp": 2, "tp": 2, "pp_schedule": "gpipe"}, "pp_tp"),
            ("src", {"pp": 2, "plan": "fsdp", "pp_schedule": "gpipe"}, None),
            ("tied", {"pp": 2, "pp_schedule": "1f1b"}, None),
            ("tied", {"pp": 2, "plan": "fsdp", "pp_schedule": "1f1b"}, None),
            ("tied", {"pp": 2, "tp": 2, "pp_schedule": "1f1b"}, None), ("tied", {"plan": "fsdp", "tp": 2}, None),
            ("s3", {"plan": "fsdp", "tp": 2}, None)]


@pytest.fixture(scope="module")
def products(tmp_path_factory: pytest.TempPathFactory, s3_server: Any
             ) -> tuple[Path, dict[str, Any], dict[str, dict], list[list[dict]]]:
    """One set of 4 gloo ranks through :data:`PRODUCTS`: hsdp (dp_replicate 2 x dp_shard 2), fsdp x tp,
    pp x tp, pp x fsdp (2 x 2 each); a tied head (Llama 3.2's tie_word_embeddings) split over pipeline
    stages (parallel/tied.py) under pp x ddp, pp x fsdp and pp x tp, and sharded under fsdp x tp; fsdp x tp
    again from an ``s3://`` copy in index-sharded files (a real moto endpoint: the ranged reader, whose
    tensor-parallel row-wise layers are read as row blocks of each FSDP shard's rows and exchanged within each
    tp group, models/hf_rows.py). The hsdp and pp x tp runs also checkpoint step 2 into
    ``<dir>/ckpt_<name>``. Returns (dir, transformers' model by source URI, storage options by source URI,
    each rank's results)."""
    import s3fs

    tmp = tmp_path_factory.mktemp("products")
    hf = save_hf(tmp / "src", scaling=LLAMA3_ROPE)
    hf.save_pretrained(str(tmp / "sharded"), max_shard_size="100KB")
    fs = s3fs.S3FileSystem(**s3_server.options())
    fs.mkdir("products")
    fs.put(str(tmp / "sharded") + "/", "products/llama/", recursive=True)
    uris = {"src": str(tmp / "src"), "tied": str(tmp / "tied"), "s3": "s3://products/llama"}
    models = {uris["src"]: hf, uris["tied"]: save_hf(tmp / "tied", tied=True, seed=1), uris["s3"]: hf}
    options = {uris["s3"]: s3_server.options()}
    runs = [(uris[src], p, str(tmp / f"ckpt_{save}") if save else None) for src, p, save in PRODUCTS]
    return tmp, models, options, _layout_runs(tmp, 4, runs, options)


def test_first_loss_equals_transformers_under_4_rank_products(products):
    _, models, options, got = products
    _check_against_transformers(got, models, 4, options)


@pytest.mark.parametrize("name", ["pp_tp", "hsdp"])
def test_export_from_a_sharded_checkpoint_reloads_in_transformers(products, tmp_path, name):
    """A source loaded under pp2 x tp2 (or hsdp 2 x 2), trained two steps and checkpointed as the worker
    does, exported with ``elastictrain ckpt export --format hf``: transformers loads the trained weights
    (every tensor exactly the values the ranks held, none the source's) and gives our Llama's logits on them."""
    from click.testing import CliRunner

    from elastictrain.checkpoint.cli import ckpt
    from elastictrain.models.hf_llama import ours_from_hf

    tmp, models, _, got = products
    i = next(k for k, run in enumerate(PRODUCTS) if run[2] == name)
    trained: dict[str, torch.Tensor] = {}
    for ranks in got:
        for n, t in ranks[i]["trained"].items():
            assert n not in trained or torch.equal(trained[n], t), n  # replicas and tp peers agree
            trained[n] = t
    for n, t in models[str(tmp / "src")].state_dict().items():  # trained: an export of the source would fail
        assert not torch.equal(t, trained[ours_from_hf(n)]), n
    res = CliRunner().invoke(ckpt, ["export", str(tmp / f"ckpt_{name}" / "step_000000002"), "--format", "hf",
                                    "--out", str(tmp_path / "hf_out")])
    assert res.exit_code == 0, res.output
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_out")).eval()
    assert {ours_from_hf(n) for n in back.state_dict()} == set(trained)
    for n, t in back.state_dict().items():
        assert torch.equal(t, trained[ours_from_hf(n)]), n
    ours = ours_from(tmp / "src")
    ours.load_state_dict(trained)
    x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (back(input_ids=x).logits - ours(x)).abs().max().item() <= LOGIT_ATOL


# ------------------------------------------------------------------------------------------------ errors
def _run_cli(tmp_path: Path, source: Path, *sets: str) -> subprocess.CompletedProcess:
    import yaml

    spec = _spec(1, str(source))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    return subprocess.run([sys.executable, "-m", "elastictrain", "run", str(tmp_path / "job.yaml"),
                           "--run-dir", str(tmp_path / "run"), *(a for s in sets for a in ("--set", s))],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=300)


def _rewrite(path: Path, change) -> None:  # noqa: ANN001
    file = path / "model.safetensors"
    tensors = dict(safetensors_torch.load_file(str(file)))
    change(tensors)
    safetensors_torch.save_file(tensors, str(file), metadata={"format": "pt"})


def test_bad_weights_are_config_errors_naming_the_tensor(tmp_path):
    """Checked on the driver from the headers, before Ray: exit 2, one line naming the tensor."""
    from elastictrain.config import build_config
    from elastictrain.config import ConfigError
    from elastictrain.task import builtin_task

    src = tmp_path / "src"
    save_hf(src)
    spec = _spec(1, str(src))
    builtin_task(build_config(spec))  # the good directory passes
    _rewrite(src, lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight", torch.zeros(96, 64)))
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.up_proj\.weight has shape \[96, 64\].*\[128, 64\]"):
        builtin_task(build_config(spec))
    _rewrite(src, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.up_proj\.weight .*is missing"):
        builtin_task(build_config(spec))
    bad = {**spec, "task": {**spec["task"], "llama": {"n_heads": 8}}}
    with pytest.raises(ConfigError, match=r"task\.llama\.n_heads=8 disagrees .*n_heads=4"):
        builtin_task(build_config(bad))
    proc = _run_cli(tmp_path, src)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "model.layers.1.mlp.up_proj.weight" in lines[0] and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------ a run on Ray, exported back
@pytest.mark.slow  # two local Ray runs (one worker each) and the CLI
def test_run_from_hf_weights_resume_and_export_back(tmp_path, ray_local):
    """ddp with one worker through Trainer: step 1's loss is transformers' loss on step 1's samples (the
    replicated start-up sync loaded the source). A run branched from its step-2 checkpoint after the source's
    weights were zeroed repeats steps 3 and 4 exactly: a resume never rereads the source. The final checkpoint
    exported with the CLI loads in transformers with the trained weights and our logits; bad exports are one
    line, exit 2."""
    from click.testing import CliRunner

    from elastictrain.checkpoint.cli import ckpt
    from elastictrain.models.hf_llama import ours_from_hf
    from tests.conftest import run_job

    hf = save_hf(tmp_path / "src", tied=True, scaling=LLAMA3_ROPE)
    spec = _spec(1, str(tmp_path / "src"))
    spec["train"]["steps"] = 4
    spec["checkpoint"] = {**spec["checkpoint"], "uri": str(tmp_path / "ckpt"), "every_steps": 2, "when_busy": "wait"}
    run = run_job(tmp_path, spec)
    assert run.result.ok, run.summary.get("error")
    first = run.of("step")[0]
    want = hf_loss(hf, _batch(spec, sorted(first["sample_ids"])))
    assert abs(first["loss"] - want) <= LOSS_RTOL * abs(want), (first["loss"], want)

    _rewrite(tmp_path / "src", lambda t: t.update({k: torch.zeros_like(v) for k, v in t.items()}))
    branch = {**spec, "run_id": "t2",
              "checkpoint": {**spec["checkpoint"], "resume": str(tmp_path / "ckpt" / "t" / "step_000000002")}}
    again = run_job(tmp_path, branch, name="branch")
    assert again.result.ok, again.summary.get("error")
    assert again.losses() == {s: run.losses()[s] for s in (3, 4)}

    step_dir = tmp_path / "ckpt" / "t" / "step_000000004"
    cli = CliRunner()
    res = cli.invoke(ckpt, ["export", str(step_dir), "--format", "hf", "--out", str(tmp_path / "hf_out")])
    assert res.exit_code == 0, res.output
    trained = run.final_params()
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_out")).eval()
    for name, t in back.state_dict().items():  # the trained weights, under Hugging Face's names
        assert torch.equal(t, trained[ours_from_hf(name)]), name
    x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    ours = ours_from(tmp_path / "hf_out")
    with torch.no_grad():
        assert (back(input_ids=x).logits - ours(x)).abs().max().item() <= LOGIT_ATOL

    for args, words in (
            ([str(tmp_path / "ckpt" / "t" / "step_000000009"), "--out", str(tmp_path / "x")], "no manifest"),
            ([str(step_dir), "--out", str(tmp_path / "hf_out")], "not an empty directory")):
        res = cli.invoke(ckpt, ["export", *args, "--format", "hf"])
        assert res.exit_code == 2 and words in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_planner_reads_the_sources_shape(tmp_path):
    from elastictrain.config import build_config
    from elastictrain.planner.job import model_shape

    save_hf(tmp_path / "src")
    shape = model_shape(build_config(_spec(1, str(tmp_path / "src"))))
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn_hidden, shape.vocab) == (
        2, 64, 4, 2, 128, 256)  # the debug preset's ffn_hidden is 192
