"""Issue 38's audit (docs/perf/2026-11-28-issue38-audit.md): the bullets no other file proved.

* every size preset, built on the meta device, has the published parameter count (Hugging Face's model
  cards: 1B, 8B, 70B and 405B), and its rotary frequencies are exactly those ``transformers`` computes for
  the published ``rope_scaling`` of that model (Llama 3.1's ``llama3`` scaling, factor 8; Llama 3.2 1B's
  factor 32);
* a Hugging Face file holding a tensor the name table does not know is a config error naming that tensor
  (tests/test_hf_llama.py covers a wrong shape and a missing tensor);
* the report (``elastictrain report``) shows the run's MFU and tokens/s per device and links each profile
  trace (tests/test_speed.py checks they reach step events and summary.json);
* a recovered generation's first step under ``parallel.compile`` (its recompile) counts in goodput's
  ``compile_s``, never as training;
* ``parallel.float8`` on a cluster whose GPUs all lack float8 (the device table's compute capability) is a
  config error on the driver, naming the GPUs and the fix;
* the Llama's blocks under full and selective recomputation: which ops run again, and no number changes.

Each was shown to fail against a build broken on purpose (the audit note names the break).
"""

from __future__ import annotations

import html.parser
import json
from typing import Any

import pytest
import torch

# (size, published parameter count, the published rope scaling of its config.json)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
PUBLISHED = [("1b", 1_235_814_400, {**LLAMA31_ROPE, "factor": 32.0}), ("8b", 8_030_261_248, LLAMA31_ROPE),
             ("70b", 70_553_706_496, LLAMA31_ROPE), ("405b", 405_853_388_800, LLAMA31_ROPE)]


@pytest.mark.parametrize("size, params, rope", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_each_preset_has_the_published_size_and_llama3_rope_scaling(size, params, rope):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from elastictrain.models.llama import Llama, llama_config, rope_frequencies

    cfg = llama_config(size, max_seq_len=16)  # the rotary tables' length: no parameter depends on it
    with torch.device("meta"):
        model = Llama(cfg)
    assert sum(p.numel() for p in model.parameters()) == params
    hf = transformers.LlamaConfig(hidden_size=cfg.dim, num_attention_heads=cfg.n_heads, rope_theta=500000.0,
                                  max_position_embeddings=131072, rope_scaling=dict(rope))
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert scale == 1.0 and cfg.rope_theta == 500000.0
    assert torch.equal(rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), want.float())


def test_a_tensor_the_name_table_does_not_know_is_a_config_error_naming_it(tmp_path):
    """Checked on the driver from the headers (task build), before any worker: one message naming it."""
    pytest.importorskip("transformers")
    from elastictrain.config import ConfigError, build_config
    from elastictrain.task import builtin_task
    from tests.test_hf_llama import _rewrite, _spec, save_hf

    src = tmp_path / "src"
    save_hf(src)
    _rewrite(src, lambda t: t.__setitem__("model.layers.0.self_attn.q_norm.weight", torch.ones(16)))
    with pytest.raises(ConfigError, match=r"tensor model\.layers\.0\.self_attn\.q_norm\.weight is not a weight "
                                          r"of this Llama") as e:
        builtin_task(build_config(_spec(1, str(src))))
    assert "\n" not in str(e.value)


class _Page(html.parser.HTMLParser):
    """The figures (``id="fig-..."`` text) and the links of a rendered report page."""

    def __init__(self) -> None:
        super().__init__()
        self.figs: dict[str, str] = {}
        self.links: list[str] = []
        self._fig: str | None = None

    def handle_starttag(self, tag, attrs):  # noqa: ANN001
        a = dict(attrs)
        if (a.get("id") or "").startswith("fig-"):
            self._fig = a["id"][4:]
        if tag == "a" and "profile" in (a.get("class") or ""):
            self.links.append(a["href"])

    def handle_data(self, data):  # noqa: ANN001
        if self._fig is not None:
            self.figs[self._fig] = data
            self._fig = None


def test_the_report_shows_mfu_and_tokens_per_device_and_links_the_traces(tmp_path):
    from elastictrain.report import write_report

    t0 = 1000.0
    steps = [{"event": "step", "time": t0 + 1 + s, "finished_at": t0 + 1 + s, "step": s, "loss": 5.0, "world_size": 2,
              "step_s": 1.0, "samples_per_s": 8.0, "tokens_per_s": 512.0, "tokens_per_s_per_device": 256.0,
              "mfu": 0.4215} for s in (1, 2, 3)]
    files = ["profiles/step2_rank0.json", "profiles/step2_rank1.json"]
    saved = [{"event": "profile_saved", "time": t0 + 3.5, "rank": r, "step": 2, "files": [f]}
             for r, f in enumerate(files)]
    events = [{"event": "run_started", "time": t0, "name": "p", "run_id": "p", "workers_max": 2}, *steps, *saved]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = {"state": "finished", "exit_code": 0, "final_step": 3, "wall_s": 5.0, "mfu": 0.4215,
               "tokens_per_s_per_device": 256.0, "run_id": "p",
               "profiles": [{"rank": e["rank"], "step": 2, "files": e["files"]} for e in saved]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = _Page()
    page.feed(write_report(tmp_path, png=False)["html"].read_text())
    assert page.figs["mfu"] == "42.1%", page.figs
    assert float(page.figs["tokens-per-s-per-device"].replace(",", "")) == 256.0
    assert page.links == files  # relative to the run directory, where the report is written beside profiles/


def test_a_recovered_generations_recompile_counts_as_compile_time_not_training(tmp_path):
    """``parallel.compile`` after a recovery: the new generation's first step (its blocks compiled again, or
    served by a standby's compile ahead) reports ``compile_s``, and its time goes to goodput's ``compile_s``
    beside the recovery's own buckets, never to productive time; a redone step's compiling attempt is lost
    work (``redone_s``). tests/test_speed.py checks generation 0's first step alone."""
    from elastictrain.controller.ledger import Ledger
    from elastictrain.events import EventLog
    from elastictrain.worker.loop import StepRecord

    log = EventLog(tmp_path, console=None)
    ledger = Ledger(log, total_steps=4, global_batch=4, max_workers=2, cpu_peak_flops=1e10)

    def record(step: int, step_s: float, compile_s: float | None = None) -> StepRecord:
        return StepRecord(step=step, loss=1.0, world_size=2, accum=1, step_s=step_s, compute_s=step_s,
                          finished_at=float(step), tokens=256, flops_per_token=1e6, devices=2, compile_s=compile_s)

    ledger.new_generation(0, 2, 1)
    events = [ledger.add(0, record(1, 5.0, 5.0), complete=True)[0], ledger.add(0, record(2, 0.5), complete=True)[0]]
    ledger.add_time("recovery", 2.0)  # a failure after step 2; the survivors regroup (generation 1) ...
    ledger.rewind(1)  # ... from a snapshot of step 1: step 2 is redone, compiling again
    ledger.new_generation(1, 2, 1)
    events += [ledger.add(0, record(2, 3.0, 3.0), complete=True)[0], ledger.add(0, record(3, 0.5), complete=True)[0]]
    assert [e.get("compile_s") for e in events] == [5.0, None, 3.0, None]
    assert events[2]["redone"] and events[2]["lost_s"] == 0.5
    summary = ledger.summary("finished", {})
    g = summary["goodput"]
    assert g["compile_s"] == 5.0 + 3.0 and g["recovery_s"] == 2.0  # both compiling first steps
    assert g["productive_s"] == 0.5 and g["redone_s"] == 0.5  # step 3; step 2's first attempt, superseded
    assert summary["mfu"] == pytest.approx(1e6 * 256 / 0.5 / (2 * 1e10))  # step 3's: compiling steps left out
    log.close()


@pytest.mark.parametrize("types, refused", [
    (["A100"], "A100 (compute capability 8.0)"), (["A100-40G", "A100"], "A100 (compute capability 8.0), A100-40G"),
    (["H100"], None), (["A100", "H100"], None), (["L4"], None), (["MI300X"], None), (["V100"], None), ([], None)])
def test_float8_on_a_cluster_of_older_gpus_is_a_config_error_naming_why(types, refused):
    """The driver's pre-flight (elastictrain/preflight.py, after Ray is up): Ray's accelerator types of the GPU
    nodes against the device table's compute capability. Refused only where every GPU is known to lack float8;
    an unknown type (V100 is not in the table) or a mixed cluster is left to the worker's own check."""
    from elastictrain.config import ConfigError, build_config
    from elastictrain.preflight import check_float8_gpus

    cfg = build_config({"parallel": {"float8": True, "plan": "fsdp"}, "workers": {"use_gpu": True}})
    if refused is None:
        check_float8_gpus(cfg, types)
        return
    with pytest.raises(ConfigError) as e:
        check_float8_gpus(cfg, types)
    msg = str(e.value)
    assert refused in msg and "compute capability >= 8.9" in msg and "set parallel.float8=false" in msg
    assert "\n" not in msg
    check_float8_gpus(build_config({"workers": {"use_gpu": True}}), types)  # float8 off: nothing to refuse


def _llama_forward_backward(ac: Any) -> tuple[dict[str, int], float, dict[str, torch.Tensor]]:
    """One forward and backward of the debug Llama parallelized (one gloo rank) under
    ``activation_checkpointing=ac``: the aten ops run (matmuls, SDPA, RMSNorm's rsqrt), the loss, the gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from elastictrain.config import ParallelConfig
    from elastictrain.models.llama import Llama, llama_config
    from elastictrain.parallel.parallelize import parallelize

    counts = {"mm": 0, "sdpa": 0, "rsqrt": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            name = func.overloadpacket.__name__
            key = "mm" if name in ("mm", "addmm", "bmm") else "sdpa" if "scaled_dot_product" in name else name
            if key in counts:
                counts[key] += 1
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = parallelize(Llama(llama_config("debug", max_seq_len=16)), init_device_mesh("cpu", (1,)),
                            ParallelConfig(activation_checkpointing=ac)).module
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        with Count():
            loss = model(ids).float().logsumexp(-1).mean()
            loss.backward()
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
        return counts, loss.item(), grads
    finally:
        dist.destroy_process_group()


def test_the_llamas_blocks_recompute_selectively_or_fully_and_change_no_number():
    """Activation checkpointing comes with the Llama as with the GPT (tests/test_speed.py checks the GPT):
    full recomputation reruns each block's matmuls and attention, selective reruns RMSNorm (its rsqrt) but
    no matmul and no attention; the loss and every gradient are bitwise those without checkpointing."""
    none, full, sel = (_llama_forward_backward(ac) for ac in (False, "full", "selective"))
    (cn, ln, gn), (cf, lf, gf), (cs, ls, gs) = none, full, sel
    assert cs["mm"] == cn["mm"] < cf["mm"] and cs["sdpa"] == cn["sdpa"] < cf["sdpa"], (cn, cf, cs)
    assert cs["rsqrt"] == cf["rsqrt"] > cn["rsqrt"], (cn, cf, cs)
    assert ln == lf == ls and set(gn) == set(gf) == set(gs)
    for name, g in gn.items():
        assert torch.equal(gf[name], g) and torch.equal(gs[name], g), name
