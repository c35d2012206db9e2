"""The planner prices expert parallel (issue 39): the parameter counts include the experts (equal to the
built-in models' own), each rank holds ``1 / ep`` of the experts' weights, gradients and optimizer state, the
all-to-all moves ``2 x top_k x tokens x hidden`` bytes per MoE layer forward and the same backward, a GPU pays
a split-size sync per MoE layer and forward, ep x fsdp keeps 1 / dp_shard of the experts' state and gathers
them over their edp replicas, and ``--all-axes`` searches ep (runnable under ddp and fsdp). Pure arithmetic, no process.
Against broken builds: a rank's parameters not dividing the experts by ep fails the memory test (and the
search's); an all-to-all priced once per direction instead of dispatch + combine fails the volume test."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from elastictrain.planner import GIB, Candidate, Cluster, ModelShape, Training, memory, rank_layouts, step_time
from elastictrain.planner.memory import moe_block_extra_bytes, rank_params
from elastictrain.planner.steptime import EP_SPLIT_SYNC_S, moved_bytes, step_flops

GPU = dict(device_memory=80 * GIB, flops=400e12, intra_node_bw=450e9, inter_node_bw=50e9)
MOE = ModelShape(layers=4, hidden=256, heads=4, seq_len=128, vocab=1000, experts=8, top_k=2)
DENSE = ModelShape(layers=4, hidden=256, heads=4, seq_len=128, vocab=1000)
TRAIN = Training(global_batch=32, micro_batch=2)  # fp32, Adam: 4 + 4 + 8 bytes per parameter


@pytest.mark.parametrize("kind, moe", [("tiny_gpt", {"experts": 8, "top_k": 2}),
                                       ("tiny_gpt", {"experts": 4, "top_k": 1, "every": 2}),
                                       ("llama", {"experts": 4, "top_k": 2})])
def test_parameter_counts_include_the_experts(kind, moe) -> None:
    from elastictrain import build_config
    from elastictrain.planner.job import model_shape
    from elastictrain.task import builtin_task

    model = ({"seq_len": 32, "n_layer": 2, "n_head": 2, "d_model": 32, "moe": moe} if kind == "tiny_gpt"
             else {"seq_len": 32, "moe": moe})
    task = {"kind": kind, "model": model}
    if kind == "llama":
        task["llama"] = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 48}
    cfg = build_config({"task": task})
    built = builtin_task(cfg).model_fn()
    assert model_shape(cfg).total_params == sum(p.numel() for p in built.parameters())


def test_each_rank_holds_its_share_of_the_experts_and_their_state() -> None:
    cl = Cluster(nodes=1, devices_per_node=8, **GPU)
    experts = MOE.expert_params
    assert experts == 4 * 8 * (2 * 1024 * 256 + 1024 + 256)
    one, two = (memory(MOE, TRAIN, cl, Candidate(dp_replicate=4, ep=e, micro_batch=2)) for e in (1, 2))
    assert rank_params(MOE, Candidate(dp_replicate=4, ep=2)) == MOE.total_params - experts / 2
    for kind, per in (("params", 4), ("grads", 4), ("optimizer", 8)):  # 1/ep of the experts' bytes of each kind
        assert getattr(one, kind) - getattr(two, kind) == pytest.approx(experts / 2 * per), kind
    assert one.activations == two.activations  # ep moves tokens, not activations
    # an MoE block's activations: top_k slots through the MLP and the dispatch buffers
    sbh = MOE.seq_len * 2 * MOE.hidden
    assert moe_block_extra_bytes(MOE, TRAIN, Candidate(micro_batch=2)) == sbh * (19 + 12) * 4 / 2
    assert moe_block_extra_bytes(DENSE, TRAIN, Candidate(micro_batch=2)) == 0


def test_all_to_all_volume_and_the_split_size_sync() -> None:
    gpu = Cluster(nodes=1, devices_per_node=8, **GPU)
    cpu = Cluster(nodes=1, devices_per_node=8, kind="cpu", **GPU)
    c = Candidate(dp_replicate=4, ep=2, micro_batch=2)
    tokens = TRAIN.global_batch * MOE.seq_len / 4
    # forward: dispatch + combine (2 x top_k x tokens x hidden x 4 bytes), backward the same; half leaves
    want = MOE.moe_layers * 2 * (2 * 2 * tokens * 256 * 4) * (2 - 1) / 2
    assert moved_bytes(MOE, TRAIN, gpu, c)["ep"] == want
    assert moved_bytes(MOE, TRAIN, gpu, Candidate(dp_replicate=4, micro_batch=2))["ep"] == 0
    m = TRAIN.global_batch // (4 * 2)
    gpu_ep, cpu_ep = step_time(MOE, TRAIN, gpu, c).ep_s, step_time(MOE, TRAIN, cpu, c).ep_s
    assert gpu_ep == pytest.approx(want / gpu.intra_node_bw + m * MOE.moe_layers * EP_SPLIT_SYNC_S)
    assert cpu_ep == pytest.approx(want / cpu.intra_node_bw)  # no device to sync with
    # compute counts the active parameters: top_k of the E experts per token
    dense_part = MOE.total_params - MOE.expert_params
    active = dense_part + MOE.expert_params * 2 / 8
    attn = 12 * 4 * 256 * 128
    assert step_flops(MOE, TRAIN, c) == pytest.approx(tokens * (6 * active + attn))
    # DDP reduces the dense gradients over 4; the experts' over their 2 replicas
    ddp_bytes = moved_bytes(MOE, TRAIN, gpu, c)["dp_replicate"]
    assert ddp_bytes == pytest.approx(2 * 3 / 4 * dense_part * 4 + 2 * 1 / 2 * MOE.expert_params / 2 * 4)


def test_ep_x_fsdp_state_share_and_expert_units() -> None:
    """ep x fsdp (parallel/parallelize.py ``shard_experts``): every rank keeps 1 / (ep x edp) = 1 / dp_shard of
    the experts' state, as of the dense part, so the state does not change with ep (fsdp shards it all
    anyway); what ep saves is the gathered experts (E / ep per MoE layer) and their traffic: each MoE layer's
    experts gathered and reduce-scattered over their edp replicas, its router over every data rank. Against
    broken builds: the state priced as ``rank_params / dp_shard`` (experts divided by ep twice) fails the
    params check; the experts' traffic over the dp group instead of edp fails the calls check."""
    from elastictrain.planner.memory import state_params
    from elastictrain.planner.steptime import collective_calls

    cl = Cluster(nodes=1, devices_per_node=8, **GPU)
    dense = MOE.total_params - MOE.expert_params
    for ep in (1, 2, 4):
        c = Candidate(dp_shard=4, ep=ep, micro_batch=2)
        assert state_params(MOE, c) == pytest.approx(dense / 4 + MOE.expert_params / 4), ep
        assert memory(MOE, TRAIN, cl, c).params == pytest.approx(MOE.total_params / 4 * 4), ep
    # ddp ep keeps 1/ep of the experts whole: more state than fsdp's 1/dp_shard
    assert state_params(MOE, Candidate(dp_replicate=4, ep=2)) == MOE.total_params - MOE.expert_params / 2
    moved = [moved_bytes(MOE, TRAIN, cl, Candidate(dp_shard=4, ep=e, micro_batch=2))["dp_shard"] for e in (1, 2)]
    assert moved[1] < moved[0]  # the experts gathered over 2 replicas (1/2 of them each), not over 4
    m = TRAIN.global_batch // (4 * 2)
    groups = collective_calls(MOE, TRAIN, cl, Candidate(dp_shard=4, ep=2, micro_batch=2)).groups
    units = [(n, size) for kind, n, size, _ in groups if kind == "fsdp" and n == m * 2 * MOE.moe_layers]
    assert (m * 2 * MOE.moe_layers, 2) in units and (m * 2 * MOE.moe_layers, 4) in units, groups
    assert not [g for g in groups if g[0] == "replicate"], groups  # no ddp all-reduce of the experts


def test_all_axes_search_prices_ep_and_marks_what_runs() -> None:
    cl = Cluster(nodes=1, devices_per_node=8, **GPU)
    ranked = rank_layouts(MOE, TRAIN, cl, runnable_only=False)
    eps = {e.candidate.ep for e in ranked}
    assert eps == {1, 2, 4, 8}, eps
    for e in ranked:  # ep runs under ddp, fsdp or hsdp, a multiple of tp, with any pp, cp and tp
        c = e.candidate  # (parallel.layout.ep_rule)
        runs = c.layout_name in ("ddp", "fsdp", "hsdp") and c.ep % c.tp == 0
        assert e.runnable == ((c.ep == 1 and c.tp == 1) or (c.ep > 1 and runs)), c.describe()
    assert any(e.runnable and e.candidate.ep > 1 and e.candidate.layout_name == "fsdp" for e in ranked)
    assert {e.candidate.ep for e in rank_layouts(DENSE, TRAIN, cl, runnable_only=False)} == {1}
    assert any(e.candidate.ep > 1 for e in rank_layouts(MOE, TRAIN, cl))  # and runnable ones are chosen from


def test_plan_all_axes_cli_lists_ep(monkeypatch) -> None:
    from pathlib import Path

    from elastictrain.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    out = CliRunner().invoke(main, ["plan", "jobs/tiny_gpt.yaml", "--json", "--all-axes", "--nodes", "1",
                                    "--gpus-per-node", "4", "--set", "task.model.moe={experts: 4, top_k: 2}"],
                             catch_exceptions=False)
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    assert {r["ep"] for r in rows} == {1, 2, 4} and all(r["ep_comm_s"] > 0 for r in rows if r["ep"] > 1)
    assert all(math.isfinite(r["step_time_s"]) for r in rows)


def test_plan_auto_runs_the_ep_it_priced() -> None:
    """``parallel.plan: auto`` on an MoE job: the chosen candidate's ep is what the concrete config runs (the
    job's own ep does not survive the choice), and a valid config (ep under ddp or fsdp)."""
    from elastictrain import build_config
    from elastictrain.planner.job import choose

    cfg = build_config({"task": {"model": {"seq_len": 32, "n_layer": 2, "n_head": 2, "d_model": 64,
                                           "moe": {"experts": 8, "top_k": 2}}},
                        "train": {"global_batch": 16, "micro_batch": 2}, "workers": {"min": 4, "max": 4},
                        "parallel": {"plan": "auto"}})
    cl = Cluster(nodes=1, devices_per_node=4, **GPU)
    concrete, choice = choose(cfg, cl, [4])
    assert concrete.parallel.ep == choice.estimate.candidate.ep == choice.parallel["ep"]
    assert concrete.parallel.ep == 1 or concrete.parallel.plan in ("ddp", "fsdp")


def test_meta_init_keeps_ddp_ep_among_the_layouts_that_hold_no_whole_model() -> None:
    """With ``parallel.meta_init`` the planner picks only layouts where no rank holds the whole model: ddp x
    ep (each rank holds 1/ep of the experts, built on meta) is one, plain ddp is not. Against the older
    filter (fsdp or no data ranks only): ddp x ep is dropped."""
    from elastictrain.planner.job import holds_no_whole_model

    assert holds_no_whole_model(Candidate(dp_replicate=2, ep=2))
    assert holds_no_whole_model(Candidate(dp_shard=4, ep=2)) and holds_no_whole_model(Candidate(tp=2))
    assert not holds_no_whole_model(Candidate(dp_replicate=2))


# ------------------------------------------------------------------ ep at a resize, and what is chosen from

# A shape whose best fitting candidate by the axes alone is one the code base refuses (a mixture-of-experts
# model under tp with ep 1: every tp rank would route the same tokens through every expert).
WIDE = ModelShape(layers=4, hidden=4096, heads=32, seq_len=128, vocab=32000, experts=8, top_k=2)


def test_only_runnable_candidates_are_chosen_from() -> None:
    """``rank_layouts`` (what ``plan: auto``, a live re-plan and ``elastictrain plan`` without ``--all-axes``
    choose from) holds only candidates that run: the axes alone let ep x pp x tp and tp without ep through.
    Against the build that filtered by axes only: the first fitting candidate of WIDE is ``single, tp 2, pp
    4 gpipe, mb 2`` (not runnable), and ``choose`` would pass it to the run (the config accepts it, the task
    refuses it at start)."""
    cl = Cluster(nodes=1, devices_per_node=8, **GPU)
    everything = [e for e in rank_layouts(WIDE, TRAIN, cl, runnable_only=False) if e.fits]
    assert not everything[0].runnable and everything[0].candidate.tp > 1, everything[0].candidate.describe()
    chosen_from = rank_layouts(WIDE, TRAIN, cl)
    assert chosen_from and all(e.runnable for e in chosen_from)
    runs = {e.candidate for e in rank_layouts(WIDE, TRAIN, cl, runnable_only=False) if e.runnable and e.candidate.cp == 1}
    assert {e.candidate for e in chosen_from} == runs  # (cp: searched with --all-axes only)


def test_a_resize_the_running_ep_cannot_divide_moves_to_another_ep() -> None:
    """ddp 8 x ep 8 shrinking to 6 (or 4 x ep 4 to 3): the running family's ep does not divide the new data
    ranks, so it cannot run there (``same_family`` None) and the move is required, to a layout whose ep
    does (each chosen ep divides its expert ranks and the experts). Against the old ``same_family``: the
    decision raised PlannerInputError (``MeshDims.ep=8 must divide the data-parallel size 6``), which a live
    run under ``plan: auto`` met at the shrink."""
    from elastictrain.planner.replan import decide, same_family

    cl = Cluster(nodes=1, devices_per_node=8, **GPU)
    train = Training(global_batch=48, micro_batch=2)
    for ep, world in ((8, 6), (4, 3)):
        old = Candidate(dp_replicate=ep, ep=ep, micro_batch=2)
        assert same_family(old, world, train) is None
        got = decide(MOE, train, cl, old, world, steps_left=100)
        new = got.new.candidate
        assert got.action == "required" and "cannot run at this size" in got.reason, got.reason
        assert new.world_size == world and MOE.experts % new.ep == 0 and (new.dp * new.cp * new.tp) % new.ep == 0
    # the family keeps its ep where it divides: ddp 4 x ep 2 at 2 is ddp 2 x ep 2
    assert same_family(Candidate(dp_replicate=4, ep=2, micro_batch=2), 2, train).dims.ep == 2


def test_the_running_family_keeps_whole_cp_groups() -> None:
    """cp2 x dp2 at 2 ranks is cp2 x dp1 (a cp group kept whole, like tp's and pp's); at 3, none. Against the
    old ``same_family`` (cp left out of the group size): a 4-rank candidate for 2 ranks."""
    from elastictrain.planner.replan import same_family

    train = Training(global_batch=48, micro_batch=2)
    fam = same_family(Candidate(dp_replicate=2, cp=2, ep=2, micro_batch=2), 2, train)
    assert fam is not None and (fam.world_size, fam.cp, fam.dp, fam.ep) == (2, 2, 1, 2), fam
    assert same_family(Candidate(dp_replicate=2, cp=2, micro_batch=2), 3, train) is None


def test_a_move_reads_each_ranks_share_of_the_experts() -> None:
    """The move to a layout reads what each rank keeps (``state_params``): under ddp x ep 4 a quarter of the
    experts with the whole dense part, so it costs less than the move to plain ddp by 3/4 of the experts'
    state. Against the old price (``stage_params / tp / dp_shard``: every rank reading every expert): the
    two moves cost the same."""
    from elastictrain.planner.inputs import OPTIMIZER_BYTES, PRECISIONS
    from elastictrain.planner.replan import move_seconds

    cl = Cluster(nodes=1, devices_per_node=8, **GPU)
    plain, ep4 = (move_seconds(MOE, TRAIN, cl, Candidate(dp_replicate=4, ep=e, micro_batch=2), 0.0) for e in (1, 4))
    w, _, master = PRECISIONS[TRAIN.precision]
    per_param = w + master + OPTIMIZER_BYTES[TRAIN.optimizer]
    assert plain - ep4 == pytest.approx(MOE.expert_params * 3 / 4 * per_param / cl.intra_node_bw)
    assert plain == pytest.approx(MOE.total_params * per_param / cl.intra_node_bw)


def test_the_plan_table_and_its_reasons_show_ep() -> None:
    """``elastictrain plan``'s table has an ``ep`` column, and the paragraph on why the winner won can name
    the experts' all-to-all (its own cost, stretched by the bubble like tp's; the bubble no longer counts
    it). Against the old table: no ep column (ddp 4 and ddp 4 x ep 2 read alike apart from their names)."""
    from elastictrain.planner import evaluate
    from elastictrain.planner.explain import _costs, table

    cl = Cluster(nodes=1, devices_per_node=8, **GPU)
    rows = [evaluate(MOE, TRAIN, cl, Candidate(dp_replicate=2, ep=e, pp=2, micro_batch=2)) for e in (1, 2)]
    head, one, two = table(rows, cl).splitlines()
    assert head.split()[2:8] == ["dp_rep", "dp_shard", "tp", "cp", "ep", "pp"], head
    at = head.index("  ep  ") + 2  # the aligned column's first character
    assert [one[at:at + 2].strip(), two[at:at + 2].strip()] == ["1", "2"], (head, one, two)
    t = rows[1].time
    costs = _costs(rows[1])
    assert t.bubble > 0 and costs["expert-parallel all-to-all"] == pytest.approx(t.ep_s / (1 - t.bubble))
    on_path = t.compute_s + t.tp_s + t.ep_s + t.cp_s + t.dispatch_exposed_s + t.fsdp_host_exposed_s
    assert costs["the pipeline bubble"] == pytest.approx(on_path / (1 - t.bubble) - on_path)  # the bubble alone
