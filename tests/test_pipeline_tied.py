"""A tied embedding split over pipeline stages (issue 36, Megatron's embedding group, parallel/tied.py): the
built-in Llama with ``tie_embeddings`` under pp2 (1f1b) on 2 gloo processes trains the numbers of one
process -- every step's loss and clipping norm, the audited samples, the final parameters -- and its
training state is the one a non-pipelined run saves (the same DCP keys), so a pp2 checkpoint resumes under
one process and a one-process checkpoint under pp2, each with the numbers of an uninterrupted run.

Tolerance: tests/test_tensor_parallel.py's harness (1e-5 relative on losses and norms, 1e-4 absolute on
parameters), for the reason tests/test_pipeline.py gives: the stages compute each sample with the
operations of one process; the sums are in another order (the tied gradient is the embedding's part plus
the head's part summed in an all-reduce instead of accumulated in one tensor; the norm is a sum over
stages). A broken build moves them by far more (shown by breaking parallel/tied.py on purpose: see
:func:`test_tied_llama_pp2_matches_one_process_and_resumes_across_layouts`'s docstring).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

TIED = {"kind": "llama", "llama": {"size": "debug", "tie_embeddings": True}}
PP2 = {"_task": TIED, "pp": 2, "pp_schedule": "1f1b", "_digest": True}
ONE = {"_task": TIED}


def _tail(run: dict[str, Any], k: int) -> dict[str, Any]:
    """``run``'s steps after the first ``k`` (with its final parameters)."""
    return {**run, "losses": run["losses"][k:], "norms": run["norms"][k:], "ids": run["ids"][k:]}


def _keys(path: str) -> set[str]:
    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def test_tied_llama_pp2_matches_one_process_and_resumes_across_layouts(tmp_path):
    """One process: 6 steps, and 3 steps saved. pp2: 3 steps (saved), 3 steps from the one-process
    checkpoint, and 3 steps from its own checkpoint on a meta-built model (what a regrouped or replaced
    stage rank restores into); then one process resumes the pp2 checkpoint for 3 steps. Every run equals the matching
    steps of the uninterrupted one-process run; the two checkpoints hold the same keys (the tied weight
    under both names, its optimizer state once, under the first).

    Against broken builds (parallel/tied.py changed on purpose, this test run): gradients not summed in
    the embedding group (``sync_grads`` a no-op) fails step 2's loss (4.7e-3 relative); the copy's norm
    counted twice (``uncounted`` empty) fails step 3's loss (2.5e-5 relative: clipping by a larger norm);
    no alias names (``alias_sources`` returning empty trees) fails the pp2 load of the one-process
    checkpoint (``Missing key in checkpoint state_dict: optim.state.output.weight.step``); the copy not
    left out of the digest (loop.py ``digest_part``) fails the digest (``output.weight ... counted 32768``)."""
    from elastictrain.parallel.digest import digest_of
    from tests.test_tensor_parallel import _matches, _run

    ddp_ckpt, pp_ckpt = str(tmp_path / "one"), str(tmp_path / "pp2")
    for d in ("ref", "pp", "back"):
        (tmp_path / d).mkdir()
    ref6, ref3 = _run(tmp_path / "ref", 1, [{**ONE, "_steps": 6}, {**ONE, "_save": ddp_ckpt}])
    pp2, pp2_resumed, pp2_rebuilt = _run(tmp_path / "pp", 2, [{**PP2, "_save": pp_ckpt}, {**PP2, "_load": ddp_ckpt},
                                                              {**PP2, "_load": pp_ckpt, "_meta": True}])
    (one_resumed,) = _run(tmp_path / "back", 1, [{**ONE, "_load": pp_ckpt}])

    _matches(pp2, ref3)
    for run in (pp2, pp2_resumed, pp2_rebuilt):  # each element of the tied weight counted once
        assert run["digest"] == digest_of(run["params"])
    # one weight under two names, as the one-process model holds it (two drifting copies would differ)
    assert torch.equal(pp2["params"]["output.weight"], pp2["params"]["tok_embeddings.weight"])
    assert _keys(pp_ckpt) == _keys(ddp_ckpt)
    assert "optim.state.tok_embeddings.weight.exp_avg" in _keys(pp_ckpt)
    _matches(pp2_resumed, _tail(ref6, 3))
    _matches(one_resumed, _tail(ref6, 3))
    _matches(pp2_rebuilt, _tail(ref6, 3))  # a regrouped rank: a meta build, its copy filled by name


@pytest.mark.slow  # ~40 s under load: importing transformers in three processes
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the Hugging Face Llama needs it")
def test_a_tied_hugging_face_llama_pp2_matches_one_process(tmp_path):
    """A model the project did not write (examples/pipeline_llama.py, ``tie_word_embeddings=True``: the
    ``model.embed_tokens``/``lm_head`` tie, the embedding inside the ``model`` container the StageSet
    merges) under pp2 1f1b trains one process's losses and parameters (tests/test_pipeline.py's harness
    and tolerance: 1e-5 relative on losses and absolute on parameters). With ``sync_grads`` a no-op
    (broken on purpose) a step's loss fails by 3.3e-3 relative."""
    from tests.test_pipeline import _matches, _run

    hf = {"llama": {"tie_word_embeddings": True}}
    (ref,) = _run(tmp_path, 1, [hf])
    (got,) = _run(tmp_path, 2, [{**hf, "pp": 2, "pp_schedule": "1f1b"}])
    _matches(got, ref)
    assert torch.equal(got["params"]["lm_head.weight"], got["params"]["model.embed_tokens.weight"])


class _Toy(torch.nn.Module):
    """A tied toy that initialises itself by module name (parallel/init.py): embedding, a layer, tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def init_module(self, module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, torch.nn.Linear):
            module.reset_parameters()


def test_each_holder_names_the_copy_as_the_whole_model_and_inits_it_by_the_first_name():
    """No process group: the two holders' StageSets (stage 0: ``emb`` and ``mid``; stage 1: ``head``, its
    own tensor) hold the tied tensor under both names, the first name first (the optimizer's key), the
    union of their keys is the whole model's, and an init by module name gives the copy the embedding's
    values (its holder is an ``nn.Embedding``, seeded by ``emb``'s name). Broken on purpose (the first name's
    holder a plain module): ``init_module`` leaves it unset and :class:`InitError` names ``emb.weight``."""
    from elastictrain.parallel.init import init_by_name
    from elastictrain.parallel.pipeline import StageSet, tied_parameters
    from elastictrain.parallel.tied import TiedSplit, TiedWeights, alias_sources

    whole = _Toy()
    (names,) = tied_parameters(whole)
    assert names == ("emb.weight", "head.weight")
    first, last = torch.nn.Module(), torch.nn.Module()
    first.emb, first.mid = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8)
    last.head = torch.nn.Linear(8, 16, bias=False)
    sets = []
    for stage, param, is_first in ((first, first.emb.weight, True), (last, last.head.weight, False)):
        tied = TiedWeights([TiedSplit(names, param, is_first, None)])
        assert tied.uncounted == (() if is_first else (param,))
        sets.append(StageSet([stage], *alias_sources(tied, [stage], whole)))
        init_by_name(sets[-1], whole, seed=3)
    init_by_name(whole, whole, seed=3)
    s0, s1 = sets
    assert [n for n, _ in s1.named_parameters()] == ["emb.weight"]  # one tensor, keyed by the first name
    assert set(s0.state_dict()) | set(s1.state_dict()) == set(whole.state_dict())
    assert {"emb.weight", "head.weight"} <= set(s0.state_dict()) & set(s1.state_dict())
    assert torch.equal(s1.head.weight, s0.emb.weight) and torch.equal(s0.emb.weight, whole.emb.weight)
    assert s1.head.weight is s1.emb.weight and s0.head.weight is s0.emb.weight


@pytest.mark.slow  # 4 processes on this machine's 2 cores: ~40 s
def test_tied_llama_pp4_and_pp2_by_fsdp2_match_one_process(tmp_path):
    """pp4 (the embedding group a subgroup of the first and last stage's ranks, not the pp group) and pp2 x
    fsdp2 (the tied tensor a DTensor shard on each stage's dp mesh, summed shard by shard) on 4 processes
    train one process's numbers (the harness's tolerance, as above)."""
    from tests.test_tensor_parallel import _matches, _run

    four = {"kind": "llama", "llama": {"size": "debug", "tie_embeddings": True, "n_layers": 4}}
    (tmp_path / "one").mkdir()
    (ref,) = _run(tmp_path / "one", 1, [{"_task": four}])
    pp4, pp2_fsdp2 = _run(tmp_path, 4, [{"_task": four, "pp": 4, "pp_schedule": "1f1b"},
                                        {"_task": four, "pp": 2, "pp_schedule": "1f1b", "plan": "fsdp"}])
    _matches(pp4, ref)
    _matches(pp2_fsdp2, ref)


@pytest.mark.slow  # two runs on the session's local Ray and an in-process reference: ~60 s under load
def test_tied_llama_pp2_through_the_controller_resumes_under_ddp1(tmp_path, ray_local):
    """The framework's path (workers on local Ray, the controller, the workers' checkpoints, the final model
    written sharded and checked against the digest the driver combines from every rank): the tied Llama
    under pp2 for 4 steps, its checkpoint resumed by one worker to 6 steps, equals 6 uninterrupted steps in
    one process (tests/parallel_fixtures.py's tolerance: 1e-5 on losses and parameters). Broken on purpose
    (the copy counted in the digest: loop.py ``digest_part`` without its skip), the pp2 run trains its 4
    steps and ends FAILED, exit 1: the driver's digest counts the tied weight twice."""
    from tests.conftest import job, run_job
    from tests.parallel_fixtures import InProcessRun, assert_same_numbers

    def spec(world: int, steps: int, **parallel: Any) -> dict[str, Any]:
        return job(task={**TIED, "optimizer": {"lr": 3e-3, "warmup_steps": 5}},
                   train={"steps": steps, "global_batch": 8, "micro_batch": 2},
                   checkpoint={"uri": str(tmp_path / "ckpt"), "every_steps": 2, "memory_every_steps": 0},
                   workers={"min": world, "max": world}, parallel=parallel, run_id="tied-pp")

    pp = run_job(tmp_path, spec(2, 4, pp=2, pp_schedule="1f1b"), name="pp2")
    assert pp.result.exit_code == 0, pp.summary
    ddp = run_job(tmp_path, spec(1, 6), name="ddp1")
    assert ddp.result.exit_code == 0, ddp.summary
    assert [e["step"] for e in ddp.of("resumed")] == [4]
    ref = InProcessRun({**spec(1, 6), "checkpoint": {}})
    assert_same_numbers(pp, ref, steps=range(1, 5), params=False)
    assert_same_numbers(ddp, ref, steps=range(5, 7))


@pytest.mark.slow  # a pp2 run with a kill and a replacement on the session's local Ray: ~60-90 s under load
def test_tied_llama_pp2_stage_rank_killed_recovers_from_the_peer_memory_tier(tmp_path, ray_local):
    """The tied Llama under pp2 alone (1f1b, 2 workers, no checkpoint storage): stage 1's rank (the head,
    holding its copy of the tied weight under both names, parallel/tied.py) is SIGKILLed mid-step at step 4;
    no survivor holds stage 1, the peer tier (a snapshot every step) does. The replacement loads its stage
    and its copy of the tied weight from the keeper by name, rank 0 keeps its own; every step's loss (a
    redone one too) and the final parameters equal 8 uninterrupted steps in one process
    (tests/parallel_fixtures.py's recovery tolerance). Broken on purpose (``TrainingState.load_from``
    leaving the copy's names out of the restore: the replacement's copy keeps its unfilled memory), the run
    fails: NaN losses from the restored step on, then exit 1 after ``recovery.max_nonfinite_steps``."""
    from tests.conftest import job, run_job
    from tests.parallel_fixtures import RECOVERY_PARAM_ATOL, InProcessRun, assert_same_numbers
    from tests.test_pp_recovery import TIMEOUTS

    def spec(world: int, **sections: Any) -> dict[str, Any]:
        return job(task={**TIED, "optimizer": {"lr": 3e-3, "warmup_steps": 5}},
                   train={"steps": 8, "global_batch": 8, "micro_batch": 2}, workers={"min": world, "max": world},
                   recovery={"min_workers_wait_s": 240}, timeouts=dict(TIMEOUTS), run_id="tied-peer", **sections)

    kill = {"rank": 1, "step": 4, "point": "mid_step", "kind": "kill"}
    slow = [{"rank": r, "step": 1, "kind": "slow", "seconds": 0.03} for r in range(2)]
    run = run_job(tmp_path, spec(2, parallel={"pp": 2, "pp_schedule": "1f1b"}, faults=[*slow, kill],
                                 checkpoint={"memory_every_steps": 1}), name="tiedpeer")
    assert run.result.exit_code == 0 and run.summary["final_step"] == 8, run.summary
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 1)], run.of("failure")
    rec = run.of("recovered")[0]
    assert rec["source"] == "memory" and rec["lost_steps"] <= 1, rec
    assert_same_numbers(run, InProcessRun(spec(1)), param_atol=RECOVERY_PARAM_ATOL)
    final = run.final_params()  # one weight under two names after the restore, as one process holds it
    assert torch.equal(final["output.weight"], final["tok_embeddings.weight"])


def _two_uses_on_rank_0(rank: int, port: int, out: str) -> None:
    """Rank 0 holds stage 0 (the embedding) and stage 3 (the head, its own copy), as zbv places them on pp2;
    rank 1 the middle stages. Each rank writes the error it got from ``find_splits``."""
    import datetime
    import os

    import torch.distributed as dist

    from elastictrain.parallel.tied import TiedSplitError, find_splits

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        emb, head = torch.nn.Module(), torch.nn.Module()
        emb.emb, head.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False)
        mid = torch.nn.Module()
        mid.mid = torch.nn.Linear(8, 8)
        stages = [emb, head] if rank == 0 else [mid]
        try:
            find_splits([("emb.weight", "head.weight")], stages, dist.group.WORLD)
            got = "no error"
        except TiedSplitError as e:
            got = str(e)
        with open(f"{out}.{rank}", "w") as f:
            f.write(got)
    finally:
        dist.destroy_process_group()


def test_two_uses_on_one_rank_are_refused_on_every_rank(tmp_path):
    """zbv's V puts the first and the last stage on rank 0, whose two stage copies of the tied weight would
    be two tensors: refused with the fix named, and on rank 1 too (which holds no use and would otherwise
    wait in the next collective for a rank that stopped). Broken on purpose (rank 0 raising before the
    gather, as first written): rank 1 fails in the gather (gloo: connection closed by peer) instead."""
    from tests.checkpoint_fixtures import free_port
    from tests.ranks import run_ranks

    out = str(tmp_path / "err")
    run_ranks(_two_uses_on_rank_0, (free_port(), out), nprocs=2)
    for rank in (0, 1):
        got = open(f"{out}.{rank}").read()
        assert "'emb.weight', 'head.weight' fall in two pipeline stages of one rank" in got, (rank, got)
        assert "pick another parallel.pp_schedule" in got
