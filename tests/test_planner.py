"""The planner's cost model (issue 24): pure functions, checked against the worked figures of the design
literature and against elastictrain's own pipeline timelines."""

from __future__ import annotations

import dataclasses

import pytest

from elastictrain.planner import GB, GIB, Candidate, Cluster, ModelShape, Training, evaluate, memory, rank_layouts, step_time
from elastictrain.planner import comm, explain, pipeline
from elastictrain.planner.search import candidates, is_runnable, runnable_axes
from elastictrain.planner.memory import _fsdp_gathered, block_activation_bytes

LLAMA70 = ModelShape(layers=80, hidden=8192, heads=64, seq_len=4096, vocab=128256, ffn_mult=3.5,
                     params=70_000_000_000)
H100 = dict(device_memory=80 * GIB, flops=400e12, intra_node_bw=450 * GB, inter_node_bw=50 * GB)


def test_70b_mixed_precision_adam_needs_1_12_tb_of_state():
    train = Training(global_batch=8, micro_batch=1, precision="mixed", optimizer="adam")
    assert train.state_bytes_per_param == 16
    one = Cluster(nodes=1, devices_per_node=1, **H100)
    m = memory(ModelShape.from_params(70e9), train, one, Candidate())
    assert m.params + m.grads + m.optimizer == pytest.approx(1.12e12, rel=1e-9)


def test_ring_all_reduce_of_28_gb_over_8_gpus_at_600_gbs_takes_82_ms():
    assert comm.all_reduce_s(28e9, 8, 600e9) == pytest.approx(0.082, abs=0.0005)
    # the same figure out of the step-time model: DDP over 8 GPUs of one node, 14B bf16 gradients, no overlap
    node = Cluster(nodes=1, devices_per_node=8, device_memory=80 * GIB, flops=1e15, intra_node_bw=600e9,
                   inter_node_bw=50e9, overlap=0.0, latency_s=0.0)
    t = step_time(ModelShape.from_params(14e9), Training(8, 1, precision="mixed"), node, Candidate(dp_replicate=8))
    assert t.dp_s == pytest.approx(0.082, abs=0.0005) and t.dp_exposed_s == t.dp_s


def test_pipeline_bubble_8_stages_4_and_32_micro_batches():
    assert pipeline.bubble("1f1b", 8, 4) == pytest.approx(0.64, abs=0.005)
    assert pipeline.bubble("1f1b", 8, 32) == pytest.approx(0.18, abs=0.005)
    assert pipeline.bubble("interleaved_1f1b", 8, 32, 2) == pytest.approx(7 / (64 + 7))


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                                        ("interleaved_1f1b", 3), ("zero_bubble", 2), ("zbv", 2)])
def test_closed_forms_match_the_timelines_of_torchs_own_schedules(schedule, v):
    """Bubble and peak in-flight micro-batches of the closed forms equal those of parallel/bubble.py's
    timeline of torch's action lists, wherever the closed form is used."""
    from elastictrain.parallel.bubble import schedule_actions, schedule_bubble

    for p in (2, 4, 8):
        for m in (2, 4, 8, 16):
            if schedule == "zero_bubble" and m % max(1, m // p):
                continue
            acts = schedule_actions(schedule, p, m, v)
            peak = 0
            for row in acts.values():
                live = 0
                for op in row:
                    live += {"F": 1, "B": -1, "I": -1}.get(op.kind, 0)
                    peak = max(peak, live)
            assert pipeline.in_flight(schedule, p, m, v) == peak, (p, m)
            assert pipeline.bubble(schedule, p, m, v) == pytest.approx(schedule_bubble(schedule, p, m, v)), (p, m)


def test_a_plan_that_cannot_fit_is_refused_with_its_shortfall():
    one = Cluster(nodes=1, devices_per_node=1, **H100)
    train = Training(global_batch=8, micro_batch=1, precision="mixed", activation_bytes=2)
    e = evaluate(LLAMA70, train, one, Candidate())
    assert not e.fits and e.memory.shortfall == pytest.approx(e.memory.total - 80 * GIB)
    assert e.memory.shortfall > 1e12
    text = explain.refusal(e, one)
    assert "does not fit" in text and f"{e.memory.shortfall:.0f} bytes" in text
    ranked = rank_layouts(LLAMA70, train, one)
    assert ranked and not ranked[0].fits and "None of the" in explain.why(ranked, one)


def test_sharding_divides_the_state_and_checkpointing_trades_activations_for_compute():
    node = Cluster(nodes=1, devices_per_node=8, **H100)
    train = Training(global_batch=64, micro_batch=2, precision="mixed", activation_bytes=2)
    ddp, fsdp = memory(LLAMA70, train, node, Candidate(dp_replicate=8, micro_batch=2)), memory(
        LLAMA70, train, node, Candidate(dp_shard=8, micro_batch=2))
    assert fsdp.optimizer == pytest.approx(ddp.optimizer / 8) and fsdp.grads == pytest.approx(ddp.grads / 8)
    plain = Candidate(dp_shard=8, micro_batch=2)
    ac = dataclasses.replace(plain, activation_checkpointing=True)
    assert memory(LLAMA70, train, node, ac).activations < memory(LLAMA70, train, node, plain).activations / 4
    assert step_time(LLAMA70, train, node, ac).compute_s == pytest.approx(
        step_time(LLAMA70, train, node, plain).compute_s * 4 / 3, rel=0.01)
    # tp splits the blocks' weights and (with sequence parallel) the activations
    tp = Candidate(dp_shard=2, tp=4, micro_batch=2)
    assert memory(LLAMA70, train, node, tp).params == pytest.approx(
        memory(LLAMA70, train, node, Candidate(dp_shard=2, micro_batch=2)).params / 4)


def test_groups_use_the_link_they_cross():
    cl = Cluster(nodes=4, devices_per_node=8, **H100)
    c = Candidate(dp_replicate=4, tp=8)  # tp = a node; the replicas span nodes
    links = comm.group_links(cl, c)
    assert links["tp"] == cl.intra_node_bw and links["dp_replicate"] == cl.inter_node_bw
    assert comm.group_links(cl, Candidate(dp_shard=8, dp_replicate=4))["dp_shard"] == cl.intra_node_bw


def test_10000_gpus_are_planned_from_a_pruned_search():
    """Planning 10,000 GPUs stays fast because the search is small: counted, not timed."""
    cl = Cluster(nodes=1250, devices_per_node=8, **H100)
    train = Training(global_batch=20000, micro_batch=1, precision="mixed", activation_bytes=2)
    found = list(candidates(LLAMA70, train, cl, 10000))
    assert 100 < len(found) < 2000
    assert all(c.world_size == 10000 and c.tp <= 8 for c in found)
    ranked = rank_layouts(LLAMA70, train, cl, runnable_only=False)
    assert ranked[0].fits and ranked[0].candidate.tp > 1 and ranked[0].candidate.pp > 1  # 3D wins at this size
    paragraph = explain.why(ranked, cl)
    assert "wins" in paragraph and "runner-up" in paragraph


def test_only_runnable_axes_are_chosen(monkeypatch):
    """Every axis runs today, so the filter is checked with one taken away (tp, as before parallel.tp
    existed): rank_layouts() then offers no tp layout, and ranks them all, marked not runnable, when asked to."""
    from elastictrain.planner import search

    cl = Cluster(nodes=2, devices_per_node=8, **H100)
    train = Training(global_batch=64, micro_batch=1, precision="mixed", activation_bytes=2)
    assert runnable_axes() == {"dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"}
    everything = rank_layouts(LLAMA70, train, cl)
    assert any(e.candidate.tp > 1 for e in everything) and all(e.runnable for e in everything)
    assert all(e.candidate.cp == 1 for e in everything)  # cp is searched when asked (--all-axes) only
    no_tp = frozenset({"dp_replicate", "dp_shard", "pp", "cp"})
    assert not is_runnable(Candidate(tp=2), no_tp) and is_runnable(Candidate(tp=2, pp=2), runnable_axes())
    assert not is_runnable(Candidate(pp=2), frozenset({"dp_replicate"}))
    monkeypatch.setattr(search, "runnable_axes", lambda: no_tp)
    chosen = rank_layouts(LLAMA70, train, cl)
    assert chosen and all(e.candidate.tp == 1 and e.runnable for e in chosen)
    ranked = rank_layouts(LLAMA70, train, cl, runnable_only=False)
    assert {e.candidate.tp > 1 for e in ranked} == {True, False}
    assert all(e.runnable == (e.candidate.tp == 1) for e in ranked)


def test_bad_inputs_name_the_field():
    from elastictrain.planner import PlannerInputError

    with pytest.raises(PlannerInputError, match="cluster.nodes must be a positive number, got 0"):
        Cluster(nodes=0, devices_per_node=8, **H100)
    with pytest.raises(PlannerInputError, match="precision='fp8'"):
        Training(8, 1, precision="fp8")


def test_replan_keeps_switches_only_when_the_move_pays_and_moves_when_it_must():
    from elastictrain.planner.replan import decide

    model = ModelShape(layers=32, hidden=4096, heads=32, seq_len=4096, vocab=32000)
    train = Training(global_batch=256, micro_batch=1, precision="mixed", activation_bytes=2)
    old = Candidate(dp_shard=16, micro_batch=1)
    one = decide(model, train, Cluster(nodes=1, devices_per_node=8, **H100), old, 8, steps_left=1000)
    assert one.action == "keep" and one.new.candidate == Candidate(dp_shard=8, micro_batch=1)
    four = Cluster(nodes=4, devices_per_node=8, **H100)
    few = decide(model, train, four, old, 32, steps_left=1, rebuild_s=60.0)
    many = decide(model, train, four, old, 32, steps_left=1000, rebuild_s=60.0)
    assert few.action == "keep" and not few.pays_for_itself and "less than its move costs" in few.reason
    assert many.action == "switch" and many.pays_for_itself and many.saved_s > many.move_s > 60.0
    assert many.new.time.total_s < many.kept.time.total_s and many.new.fits
    event = many.as_event()
    assert event["old_layout"] == old.describe() and event["pays_for_itself"] is True
    # shrinking to 8 GPUs of 24 GiB: the running family (fsdp, no checkpointing) no longer fits
    small = Cluster(nodes=1, devices_per_node=8, **dict(H100, device_memory=24 * GIB))
    must = decide(model, train, small, old, 8, steps_left=10)
    assert must.action == "required" and not must.kept.fits and must.new.fits
    # what fits instead saves memory the family cannot: checkpointing, or tensor parallel since it runs
    assert "does not fit" in must.reason and (must.new.candidate.activation_checkpointing or must.new.candidate.tp > 1)
    assert decide(ModelShape.from_params(70e9), train, small, old, 8, steps_left=10) is None  # nothing fits


def test_memory_follows_how_elastictrain_lays_out_the_state():
    """DDP's gradients are its buckets (no second copy); at FSDP's peak (the start of backward) the root, the
    last block and the prefetched one are gathered, and a block's unsharded gradient with the
    reduce-scatter's input adds only what it exceeds the activations its backward frees by (benchmarks/
    planner.py measured the old sum of all of them ~25% over); inside a pipeline stage FSDP keeps the
    stage's weights gathered."""
    model = ModelShape(layers=8, hidden=256, heads=8, seq_len=64, vocab=256)
    train = Training(global_batch=16, micro_batch=4)
    node = Cluster(nodes=1, devices_per_node=4, **H100)
    assert memory(model, train, node, Candidate(dp_replicate=4, micro_batch=4)).gathered == 0
    block, n = model.block_params, model.total_params
    root = n - 8 * block
    thin = Candidate(dp_shard=4, micro_batch=4)
    freed = block_activation_bytes(model, train, thin)
    assert freed < 2 * block * 4  # few activations: the gradient shows above them
    assert memory(model, train, node, thin).gathered == pytest.approx((2 * block + root) * 4 + 2 * block * 4 - freed)
    thick = Candidate(dp_shard=4, micro_batch=16)
    assert block_activation_bytes(model, train, thick) > 2 * block * 4  # it hides under the freed activations
    assert memory(model, train, node, thick).gathered == pytest.approx((2 * block + root) * 4)
    staged = memory(model, train, node, Candidate(dp_shard=2, pp=2, micro_batch=4))
    stage_n = 4 * block + model.vocab * model.hidden + model.seq_len * model.hidden
    assert staged.gathered == pytest.approx(stage_n * 4)  # its gradients are priced whole (next test)


def test_a_pipeline_ranks_fsdp_gradients_are_whole_until_the_last_backward():
    """torch's PipelineStage turns FSDP's gradient sync off for every backward but the step's last, so a
    pp x fsdp rank accumulates its stage's whole fp32 gradient: priced unsharded (the old model divided it by
    dp_shard, 8x short on the 70B layouts of issue 36), while pp x ddp and fsdp alone are unchanged."""
    model = ModelShape(layers=8, hidden=256, heads=8, seq_len=64, vocab=256)
    node = Cluster(nodes=1, devices_per_node=8, **H100)
    many = Training(global_batch=64, micro_batch=4)  # 8 micro-batches per dp rank: more than pp in flight
    stage_n = 4 * model.block_params + model.vocab * model.hidden + model.seq_len * model.hidden
    for shard in (2, 4):
        staged = memory(model, many, node, Candidate(dp_shard=shard, pp=2, micro_batch=4))
        assert staged.grads == pytest.approx(stage_n * 4)
        assert staged.params == pytest.approx(stage_n * 4 / shard)  # the fp32 shards stay sharded
    assert memory(model, many, node, Candidate(dp_replicate=2, pp=2, micro_batch=4)).grads == pytest.approx(
        stage_n * 4)
    assert memory(model, many, node, Candidate(dp_shard=4, micro_batch=4)).grads == pytest.approx(
        model.total_params * 4 / 4)


def test_bf16_without_fsdp_holds_fp32_state_and_a_bf16_cast_per_micro_batch_in_flight():
    """parallel.mixed_precision=bf16 under ddp (autocast): fp32 weights, gradients and Adam (16 B/param, as
    fp32), bf16 activations, and one bf16 cast of the rank's weights per micro-batch in flight (autograd keeps
    it for that micro-batch's backward): one without a pipeline, in_flight units of a virtual stage's weights
    in one. FSDP's pricing is unchanged by it (its gathered copies are FSDP2's policy's)."""
    model = ModelShape(layers=8, hidden=256, heads=8, seq_len=64, vocab=256)
    node = Cluster(nodes=1, devices_per_node=8, **H100)
    fp32, bf16 = Training(64, 4), Training(64, 4, precision="bf16", activation_bytes=2)
    n = model.total_params
    ddp, ddp32 = (memory(model, t, node, Candidate(dp_replicate=2, micro_batch=4)) for t in (bf16, fp32))
    assert (ddp.params, ddp.grads, ddp.optimizer) == (ddp32.params, ddp32.grads, ddp32.optimizer) == (
        pytest.approx(n * 4), pytest.approx(n * 4), pytest.approx(n * 8))
    assert ddp.gathered == pytest.approx(n * 2) and ddp32.gathered == 0
    assert ddp.activations < 0.6 * ddp32.activations  # bf16 (the last stage's fp32 logits aside)
    stage_n = 4 * model.block_params + model.vocab * model.hidden + model.seq_len * model.hidden
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        c = Candidate(dp_replicate=2, pp=2, micro_batch=4, schedule=schedule, stages_per_rank=v)
        units = pipeline.in_flight(schedule, 2, 64 // (2 * 4), v)
        assert memory(model, bf16, node, c).gathered == pytest.approx(units * stage_n / v * 2), schedule
    tp = memory(model, bf16, node, Candidate(dp_replicate=2, tp=2, micro_batch=4))
    assert tp.gathered == pytest.approx(tp.params / 4 * 2)  # the rank's (tp-split) weights, cast once
    fsdp = Candidate(dp_shard=2, micro_batch=4)  # bf16 gathered copies, no cast term
    assert memory(model, bf16, node, fsdp).gathered == _fsdp_gathered(model, bf16, fsdp, n)


def test_gradients_count_at_the_peak_only_where_they_exist_then():
    """The step loop drops the gradients after each step except DDP's buckets: one micro-batch under FSDP
    peaks before any gradient exists; accumulation (a second micro-batch) peaks with all of them."""
    model = ModelShape(layers=8, hidden=256, heads=8, seq_len=64, vocab=256)
    node = Cluster(nodes=1, devices_per_node=4, **H100)
    n = model.total_params
    one = Training(global_batch=16, micro_batch=4)  # dp 4 x micro 4: one micro-batch per step
    assert memory(model, one, node, Candidate(dp_replicate=4, micro_batch=4)).grads == n * 4  # buckets
    assert memory(model, one, node, Candidate(dp_shard=4, micro_batch=4)).grads == 0
    two = Training(global_batch=32, micro_batch=4)  # two micro-batches: the first one's gradients are held
    assert memory(model, two, node, Candidate(dp_shard=4, micro_batch=4)).grads == n * 4 / 4
    # a pipeline stage holding every micro-batch in flight peaks before its first backward
    assert memory(model, one, node, Candidate(dp_replicate=2, pp=2, micro_batch=4)).grads == 0


def test_sequence_parallel_keeps_the_gathered_linear_inputs_whole():
    """torch's DTensor saves the column-wise linears' gathered inputs (q/k/v's and mlp_in's: 4 of the 34
    units of s*b*h at 2 bytes) over the whole sequence; the other 30 split over tp."""
    model = ModelShape(layers=8, hidden=256, heads=8, seq_len=64, vocab=256)
    train = Training(global_batch=16, micro_batch=4, activation_bytes=2)
    one = block_activation_bytes(model, train, Candidate(micro_batch=4))
    sp = block_activation_bytes(model, train, Candidate(tp=2, micro_batch=4))
    no_sp = block_activation_bytes(model, train, Candidate(tp=2, micro_batch=4, sequence_parallel=False))
    unit = 64 * 4 * 256
    assert one == pytest.approx(34 * unit)
    assert sp == pytest.approx((30 / 2 + 4) * unit)
    assert no_sp == pytest.approx((10 + 24 / 2) * unit)


SMALL = ModelShape(layers=12, hidden=384, heads=8, seq_len=128, vocab=256)  # benchmarks/planner.py's GPT
CPU4 = dict(nodes=1, devices_per_node=4, device_memory=8 * GIB, flops=50e9, intra_node_bw=2e9, inter_node_bw=1e9,
            latency_s=1e-4, call_s=5e-3, optimizer_s_per_param=1e-8, overlap=0.1, kind="cpu")


def test_ranks_that_share_cores_take_turns_and_a_gpus_figures_keep_their_meaning():
    """4 processes on 2 cores: a step takes at least twice one rank's compute and optimizer step plus its
    communication (priced at the contended rate the calibration measures), and
    a pipeline rank idle in its bubble lends its core instead of stretching the step; with as many cores as
    ranks (or none given: GPUs) the critical path alone, as before."""
    train = Training(global_batch=16, micro_batch=4)
    shared, own = Cluster(**CPU4, cores_per_node=2), Cluster(**CPU4, cores_per_node=4)
    gpu_like = Cluster(**CPU4)  # cores_per_node None: every device computes on its own
    assert (shared.share(4), shared.share(2), own.share(4), gpu_like.share(4)) == (2.0, 1.0, 1.0, 1.0)
    ddp = Candidate(dp_replicate=4, micro_batch=4)
    a, b = step_time(SMALL, train, shared, ddp), step_time(SMALL, train, own, ddp)
    assert a.total_s == pytest.approx(2 * (a.compute_s + a.optimizer_s) + a.dp_s + a.calls_s)
    assert a.total_s > 1.8 * b.total_s
    assert b.total_s == pytest.approx(b.path_s + b.calls_s) == step_time(SMALL, train, gpu_like, ddp).total_s
    pp = Candidate(dp_replicate=2, pp=2, micro_batch=4)  # 2 micro-batches: a third of the step idle
    t = step_time(SMALL, train, shared, pp)
    assert t.bubble == pytest.approx(1 / 3) and t.path_s < t.busy_s and t.total_s == pytest.approx(t.busy_s + t.calls_s)
    assert step_time(SMALL, train, own, pp).total_s == pytest.approx(step_time(SMALL, train, own, pp).path_s
                                                                     + step_time(SMALL, train, own, pp).calls_s)
    assert step_time(SMALL, train, own, pp).path_s > step_time(SMALL, train, own, pp).compute_s * 1.5


def test_collective_calls_are_counted_per_block_and_micro_batch():
    """What benchmarks/planner.py's layouts call per step (counted with torch.profiler on 4 gloo processes:
    tp2 204 all-gathers and reduce-scatters, fsdp 24 gathers and 13 reductions, ddp 4 buckets; and tp2's one
    flat all-reduce of the norms' partial gradients), each call priced at call_s plus its ring steps' latency."""
    from elastictrain.planner.steptime import collective_calls

    train = Training(global_batch=16, micro_batch=4)
    cl = Cluster(**CPU4, cores_per_node=2)

    def count(c: Candidate, what: str) -> float:
        return sum(n for w, n, size, _ in collective_calls(SMALL, train, cl, c).groups if w == what and size > 1)

    tp = Candidate(dp_replicate=2, tp=2, micro_batch=4)  # 2 micro-batches of 12 blocks, sequence parallel
    assert count(tp, "tp") == 2 * (12 * 8 + 6) + 1 and count(tp, "step") == 2
    fsdp = Candidate(dp_shard=4, micro_batch=4)
    assert count(fsdp, "fsdp") == 24 + 13
    assert count(Candidate(dp_replicate=4, micro_batch=4), "replicate") == 4  # 85 MB of fp32 gradients in 25 MiB
    assert count(Candidate(dp_replicate=2, pp=2, micro_batch=4), "pp") == 4
    assert count(Candidate(dp_replicate=2, dp_shard=2, micro_batch=4), "replicate") == 13  # HSDP: per unit
    # each call costs call_s (+ latency per ring step): TP's are on the critical path, not hidden
    cheap = dataclasses.replace(cl, call_s=0.0)
    t, t0 = step_time(SMALL, train, cl, tp), step_time(SMALL, train, cheap, tp)
    ring = collective_calls(SMALL, train, cl, tp).cost_s(cheap, "tp", "pp", "step")
    assert t.calls == 205 + 2 + 2 and t.calls_s == pytest.approx(207 * 5e-3 + ring)  # + ddp's 2 buckets
    assert t.total_s - t0.total_s == pytest.approx(209 * 5e-3, rel=1e-6)


def test_a_gpu_cluster_prices_calls_as_before_when_it_has_no_call_cost():
    """GPU figures (no core sharing, call_s 0): per-block FSDP calls add their ring latencies to the
    data-parallel traffic, which compute hides; the literature figures above are unchanged."""
    node = Cluster(nodes=1, devices_per_node=8, **H100)
    train = Training(global_batch=64, micro_batch=2, precision="mixed", activation_bytes=2)
    t = step_time(LLAMA70, train, node, Candidate(dp_shard=8, micro_batch=2))
    assert t.share == 1.0 and t.busy_s == 0.0 and t.total_s == pytest.approx(t.path_s + t.calls_s)
    assert t.dp_exposed_s == 0.0  # hidden behind compute as before


def test_tensor_parallel_pays_dtensor_dispatch_per_op_counted_from_the_shape():
    """TP's host work: each block's DTensor ops per micro-batch (forward 26 and backward 80 under sequence
    parallel, forward again with checkpointing) plus those around the blocks, at dtensor_op_s each. On CPU
    all of it is on the critical path and shared with the node's other ranks like compute; a layout
    without TP pays none; TP's calls are priced at tp_call_s where measured."""
    from elastictrain.planner.steptime import dtensor_ops

    train = Training(global_batch=16, micro_batch=4)
    tp = Candidate(dp_replicate=2, tp=2, micro_batch=4)  # 2 micro-batches of 12 blocks
    assert dtensor_ops(SMALL, train, tp) == 2 * (12 * 106 + 37)  # 2618: counted on 4 gloo processes
    assert dtensor_ops(SMALL, train, dataclasses.replace(tp, sequence_parallel=False)) == 2 * (12 * 96 + 30)
    assert dtensor_ops(SMALL, train, dataclasses.replace(tp, activation_checkpointing=True)) == 2 * (12 * 132 + 37)
    assert dtensor_ops(SMALL, train, Candidate(dp_replicate=2, pp=2, tp=1, micro_batch=4)) == 0
    assert dtensor_ops(SMALL, train, Candidate(pp=2, tp=2, micro_batch=4)) == 4 * (6 * 106 + 37)  # a stage's blocks
    for cores in (4, 2):
        cl = Cluster(**CPU4, cores_per_node=cores)
        slow = dataclasses.replace(cl, dtensor_op_s=50e-6)
        t0, t = step_time(SMALL, train, cl, tp), step_time(SMALL, train, slow, tp)
        assert t.dispatch_s == t.dispatch_exposed_s == pytest.approx(2618 * 50e-6)
        # own cores: on the critical path once; 2 ranks a core: the node does both ranks' dispatch
        assert t.total_s - t0.total_s == pytest.approx(t.dispatch_s * cl.share(4))
        ddp = Candidate(dp_replicate=4, micro_batch=4)
        assert step_time(SMALL, train, slow, ddp).total_s == step_time(SMALL, train, cl, ddp).total_s
    # TP's calls at their own measured price, the step loop's at call_s
    cl = Cluster(**CPU4, cores_per_node=2)
    dear = dataclasses.replace(cl, tp_call_s=8e-3)
    assert step_time(SMALL, train, dear, tp).calls_s - step_time(SMALL, train, cl, tp).calls_s == \
        pytest.approx(205 * 3e-3)


def test_fsdp_over_tensor_parallel_all_reduces_each_partial_gradient_per_micro_batch():
    """FSDP2 over a TP model redistributes every gradient that backward leaves Partial over tp (under sequence
    parallel the norms' weight and bias: 4 per GPT block, 2 around the blocks) to its parameter's placement
    before its reduce-scatter: one all-reduce over tp each, per micro-batch, priced like TP's other calls at
    tp_call_s (plus its ring steps); without FSDP the step sums them in one flat all-reduce, and without
    sequence parallel there are none. The old model priced neither (tp2 x dp2 24% too fast)."""
    from elastictrain.planner.steptime import collective_calls

    train = Training(global_batch=16, micro_batch=4)
    cl = Cluster(**CPU4, cores_per_node=2, tp_call_s=2e-3)
    two_d = Candidate(dp_shard=2, tp=2, micro_batch=4)  # 2 micro-batches of 12 blocks
    one_d = Candidate(dp_replicate=2, tp=2, micro_batch=4)

    def tp_calls(c: Candidate) -> float:
        return sum(n for w, n, size, _ in collective_calls(SMALL, train, cl, c).groups if w == "tp" and size > 1)

    blocks_calls = 2 * (12 * 8 + 6)  # TP's own all-gathers and reduce-scatters
    assert tp_calls(two_d) == blocks_calls + 2 * (12 * 4 + 2)
    assert tp_calls(one_d) == blocks_calls + 1
    no_sp = dataclasses.replace(two_d, sequence_parallel=False)
    assert tp_calls(no_sp) == 2 * (12 * 4 + 3)  # TP's all-reduces alone
    # each at tp_call_s plus an all-reduce's 2 ring steps (tp 2), on the critical path like TP's calls
    dear = dataclasses.replace(cl, tp_call_s=4e-3)
    assert step_time(SMALL, train, dear, two_d).total_s - step_time(SMALL, train, cl, two_d).total_s == \
        pytest.approx((blocks_calls + 100) * 2e-3)


def test_fsdp_pays_its_host_work_per_parameter_tensor_and_micro_batch():
    """FSDP2's hooks visit every parameter tensor of the rank's units each micro-batch (plain or DTensor
    parameters: fsdp, hsdp, and FSDP over TP alike): 16 per GPT block plus 5 around the blocks, neither
    dp_shard nor tp dividing them, a pipeline stage's own; at fsdp_param_s each, host work that on CPU is on
    the critical path and shared with the node's other ranks like compute. Layouts without FSDP pay none.
    The old model priced none of it (tp2 x dp2 measured 0.75-0.81 of its step)."""
    from elastictrain.planner.steptime import fsdp_param_visits

    train = Training(global_batch=16, micro_batch=4)
    per_mb = 12 * 16 + 5  # 197: the built-in GPT's tensors (tests/test_planner_tp.py counts them)
    two_d = Candidate(dp_shard=2, tp=2, micro_batch=4)  # 2 micro-batches
    assert fsdp_param_visits(SMALL, train, two_d) == 2 * per_mb
    assert fsdp_param_visits(SMALL, train, Candidate(dp_shard=4, micro_batch=4)) == per_mb  # 1 micro-batch
    assert fsdp_param_visits(SMALL, train, Candidate(dp_replicate=2, dp_shard=2, micro_batch=2)) == 2 * per_mb
    assert fsdp_param_visits(SMALL, train, Candidate(dp_shard=4, micro_batch=1)) == 4 * per_mb
    assert fsdp_param_visits(dataclasses.replace(SMALL, layers=24), train, two_d) == 2 * (24 * 16 + 5)
    assert fsdp_param_visits(dataclasses.replace(SMALL, tied_embeddings=True), train, two_d) == 2 * (per_mb - 1)
    # a stage's blocks and the larger of its edges (the first stage's 2 embeddings, the last's norm and head)
    assert fsdp_param_visits(SMALL, train, Candidate(dp_shard=2, pp=2, micro_batch=4)) == 2 * (6 * 16 + 3)
    for no_fsdp in (Candidate(dp_replicate=4, micro_batch=4), Candidate(dp_replicate=2, tp=2, micro_batch=4),
                    Candidate(dp_replicate=2, pp=2, micro_batch=4)):
        assert fsdp_param_visits(SMALL, train, no_fsdp) == 0
    for cores in (4, 2):
        cl = Cluster(**CPU4, cores_per_node=cores)
        dear = dataclasses.replace(cl, fsdp_param_s=200e-6)
        t0, t = step_time(SMALL, train, cl, two_d), step_time(SMALL, train, dear, two_d)
        assert t0.fsdp_host_s == 0.0
        assert t.fsdp_host_s == t.fsdp_host_exposed_s == pytest.approx(2 * per_mb * 200e-6)
        # own cores: on the critical path once; 2 ranks a core: the node does both ranks' host work
        assert t.total_s - t0.total_s == pytest.approx(t.fsdp_host_s * cl.share(4))
        # twice the micro-batches, twice the host work
        more = dataclasses.replace(two_d, micro_batch=2)
        assert step_time(SMALL, train, dear, more).fsdp_host_s == pytest.approx(2 * t.fsdp_host_s)
        ddp = Candidate(dp_replicate=4, micro_batch=4)
        assert step_time(SMALL, train, dear, ddp).total_s == step_time(SMALL, train, cl, ddp).total_s


def test_a_gpu_hides_fsdps_host_work_behind_its_compute_with_the_dispatch():
    """On GPUs FSDP's per-tensor host work runs ahead of the device like DTensor's dispatch: a 70B model
    hides it (the literature's figures unchanged); a narrow model shows what host work exceeds compute by."""
    node = Cluster(nodes=1, devices_per_node=8, **H100, fsdp_param_s=20e-6, kind="gpu")
    train = Training(global_batch=64, micro_batch=2, precision="mixed", activation_bytes=2)
    big = Candidate(dp_shard=8, micro_batch=2)
    t = step_time(LLAMA70, train, node, big)
    assert t.fsdp_host_s > 0 and t.fsdp_host_exposed_s == 0.0
    assert t.total_s == step_time(LLAMA70, train, dataclasses.replace(node, fsdp_param_s=0.0), big).total_s
    tiny = step_time(SMALL, Training(global_batch=8, micro_batch=1), dataclasses.replace(node, dtensor_op_s=20e-6),
                     Candidate(dp_shard=4, tp=2, micro_batch=1))
    assert tiny.dispatch_s > tiny.compute_s  # the dispatch alone exceeds the compute: all FSDP's work shows
    assert tiny.dispatch_exposed_s + tiny.fsdp_host_exposed_s == \
        pytest.approx(tiny.dispatch_s + tiny.fsdp_host_s - tiny.compute_s)
    assert tiny.fsdp_host_exposed_s == pytest.approx(tiny.fsdp_host_s)


def test_a_gpu_hides_dtensor_dispatch_behind_its_compute_up_to_the_compute():
    """On GPUs the host queues kernels ahead of the device: dispatch shows only beyond the device's compute.
    A large model (70B, tp 8) hides all of it: the literature's figures are unchanged; a narrow model whose
    kernels are shorter than their dispatch is host-bound."""
    node = Cluster(nodes=1, devices_per_node=8, **H100, dtensor_op_s=20e-6, kind="gpu")
    train = Training(global_batch=64, micro_batch=1, precision="mixed", activation_bytes=2)
    big = Candidate(dp_replicate=1, tp=8, micro_batch=1, activation_checkpointing=True)
    t = step_time(LLAMA70, train, node, big)
    assert t.dispatch_s > 0 and t.dispatch_exposed_s == 0.0
    assert t.total_s == step_time(LLAMA70, train, dataclasses.replace(node, dtensor_op_s=0.0), big).total_s
    tiny = step_time(SMALL, Training(global_batch=8, micro_batch=1), node, Candidate(tp=8, micro_batch=1))
    assert tiny.dispatch_s > tiny.compute_s
    assert tiny.dispatch_exposed_s == pytest.approx(tiny.dispatch_s - tiny.compute_s)


def test_calibration_keeps_the_mean_of_the_rounds_within_3_mads_of_their_median():
    """The TP figures of ``--calibrate`` come from every process's rounds pooled: a round that a burst of
    other work, a collection or a page fault inflated is dropped (beyond 3 scaled MADs of the median) and
    the rest averaged, instead of rank 0's median of 7 rounds (which moved 1.7x between two quiet runs)."""
    from elastictrain.planner.calibrate import steady_figure

    rounds = [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 50.0]  # one burst; the median alone would say 2.0
    got = steady_figure(rounds)
    assert got.value == pytest.approx(11 / 7) and (got.kept, got.dropped) == (7, 1)  # 50 dropped
    assert "7 of 8" in got.reason
    symmetric = [0.9, 1.1, 1.0, 0.95, 1.05, -3.0, 9.0]  # a negative round (the base loop caught the burst) too
    assert steady_figure(symmetric).value == pytest.approx(1.0) and steady_figure(symmetric).dropped == 2
    assert steady_figure([5.0] * 4).value == 5.0  # no spread: nothing dropped
    # a difference that drowned in the noise is not a figure (the planner keeps its default)
    lost = steady_figure([-1.0, 0.5, -0.5, 0.2])
    assert lost.value is None and "lost in the noise" in lost.reason
    assert steady_figure([]).value is None


def test_tp_call_price_shares_a_calls_cpu_among_the_ranks_on_a_core():
    """A TP call's CPU work (measured in CPU time: the other cores' load does not move it) holds the node
    ``share`` times as long when ranks take turns on its cores (4 ranks on 2 cores: twice); nothing comes
    off for the ring steps' latency (the model adds it per call: CPU time holds no wait for the peer)."""
    from elastictrain.planner.calibrate import tp_call_price

    assert tp_call_price(1e-3, 2.0) == pytest.approx(2e-3)
    assert tp_call_price(1e-3, 1.0) == pytest.approx(1e-3)
    assert tp_call_price(1e-3, 0.5) == pytest.approx(1e-3)  # a core each at most
    assert tp_call_price(None, 2.0) is None


def test_ranking_ties_are_layouts_measured_within_their_step_to_step_noise():
    """benchmarks/planner.py's verdict: two layouts measured closer than the larger of their noises (half
    the range of their measured steps over the median) are tied and may be predicted in either order;
    every other pair must be in the predicted order. The strict comparison called fsdp and hsdp measured
    0.6% apart and predicted 1% apart the other way a mismatch."""
    from elastictrain.planner.accuracy import compare_rankings, step_noise

    assert step_noise([2.0, 2.2, 1.8, 2.0]) == pytest.approx(0.1)
    assert step_noise([3.0]) == 0.0
    predicted = {"ddp": 2.5, "fsdp": 2.99, "hsdp": 2.95, "tp2": 3.4}
    measured = {"ddp": 2.6, "fsdp": 3.00, "hsdp": 3.018, "tp2": 3.6}  # fsdp and hsdp 0.6% apart
    noise = {"ddp": 0.01, "fsdp": 0.02, "hsdp": 0.004, "tp2": 0.01}
    v = compare_rankings(predicted, measured, noise)
    assert v.matches and v.mismatches == () and "1 tied pair" in v.reason
    assert v.predicted == ("ddp", "hsdp", "fsdp", "tp2") and v.measured == ("ddp", "fsdp", "hsdp", "tp2")
    (tie,) = v.ties
    assert (tie.a, tie.b, tie.swapped) == ("fsdp", "hsdp", True) and tie.tolerance == 0.02
    assert "0.6% apart" in tie.describe() and "2.0%" in tie.describe()
    # the same pair beyond its noise is a mismatch, named
    quiet = dict(noise, fsdp=0.004)
    v = compare_rankings(predicted, measured, quiet)
    assert not v.matches and v.mismatches == (("fsdp", "hsdp"),) and "fsdp < hsdp" in v.reason
    # a tie is not a licence for a pair far apart: tp2 predicted first is a mismatch whatever fsdp's noise
    v = compare_rankings(dict(predicted, tp2=1.0), measured, noise)
    assert not v.matches and ("ddp", "tp2") in v.mismatches
    # in order: matches with no excuse needed
    v = compare_rankings(measured, measured, {})
    assert v.matches and v.reason == "the same order" and v.ties == ()


def test_rounds_fold_into_the_median_and_count_the_drift_between_rounds_as_noise():
    """benchmarks/planner.py measures the layouts in turns over several rounds: a layout's figure is the
    median of its rounds' medians, its noise the larger of the typical step-to-step noise and the spread
    between rounds. Stop 33's two quiet runs measured fsdp at 2.82 s, then 3.18 s, each with steps within
    ~2%: one run's noise called the drift a difference between layouts."""
    from elastictrain.planner.accuracy import compare_rankings, over_rounds

    fsdp = over_rounds([[2.80, 2.82, 2.84], [3.16, 3.18, 3.20], [2.95, 3.00, 3.05]])
    assert fsdp.step_s == pytest.approx(3.00) and fsdp.medians == (2.82, 3.18, 3.00)
    assert fsdp.round_noise == pytest.approx(0.06)  # (3.18 - 2.82) / 2 / 3.00
    assert fsdp.step_noise == pytest.approx(0.02 / 2.82)  # the median of 0.0071, 0.0063, 0.0167
    assert fsdp.noise == fsdp.round_noise
    # one round: the rounds add nothing, the step-to-step noise stays
    one = over_rounds([[2.0, 2.2, 1.8, 2.0]])
    assert one.step_s == pytest.approx(2.0) and one.round_noise == 0.0 and one.noise == pytest.approx(0.1)
    # a steady machine: the steps' noise is the larger
    steady = over_rounds([[2.0, 2.4], [2.2, 2.2], [2.1, 2.3]])
    assert steady.noise == steady.step_noise == pytest.approx(0.1 / 2.2, rel=1e-6)
    # with the rounds' noise, hsdp measured 5% under fsdp is a tie; with one round's noise a mismatch
    hsdp = over_rounds([[2.80, 2.81], [2.90, 2.91], [2.85, 2.86]])
    predicted, measured = {"fsdp": 2.90, "hsdp": 2.95}, {"fsdp": fsdp.step_s, "hsdp": hsdp.step_s}
    assert compare_rankings(predicted, measured, {"fsdp": fsdp.noise, "hsdp": hsdp.noise}).matches
    assert not compare_rankings(predicted, measured, {"fsdp": 0.007, "hsdp": 0.002}).matches
    with pytest.raises(ValueError, match="no measured steps"):
        over_rounds([[], []])


def test_gloos_cpu_per_byte_is_every_ranks_host_work_on_shared_cores():
    """On CPU gloo's threads copy, send, receive and reduce a collective's bytes on the cores the ranks
    compute on: with 4 ranks on 2 cores the node does every rank's share of that work (gloo_byte_s per byte a
    rank moves, :func:`moved_bytes`), and the bytes hold it for the longer of that and the contended wall
    price they had before (which already holds the other ranks' turns: never both). With cores of their
    own, on GPUs (NCCL), or without the figure: priced as before. The old model priced the bytes once at the
    contended bandwidth whatever the CPU their processes spend on them."""
    from elastictrain.planner.memory import stage_params
    from elastictrain.planner.steptime import comm_cpu_s, moved_bytes

    train = Training(global_batch=16, micro_batch=4)
    two_d, ddp = Candidate(dp_shard=2, tp=2, micro_batch=4), Candidate(dp_replicate=4, micro_batch=4)
    fast = Cluster(**{**CPU4, "intra_node_bw": 1e12}, cores_per_node=2)  # the wire alone: nearly free
    moved = moved_bytes(SMALL, train, fast, two_d)
    assert set(moved) == {"tp", "cp", "pp", "dp_shard", "dp_replicate", "ep"} and moved["tp"] > 0 and moved["dp_shard"] > 0
    assert moved["cp"] == 0 and moved["ep"] == 0  # no context or expert parallel: no K/V gathered, no all-to-all
    t0 = step_time(SMALL, train, fast, two_d)
    assert t0.tp_s == pytest.approx(moved["tp"] / 1e12)  # seconds on a link: its bytes over its bandwidth
    # DDP: one ring all-reduce of the rank's gradients, 2 (N-1)/N of their bytes
    grads = stage_params(SMALL, ddp) * 4
    assert sum(moved_bytes(SMALL, train, fast, ddp).values()) == pytest.approx(2 * 3 / 4 * grads)
    cpu = dataclasses.replace(fast, gloo_byte_s=1e-9)
    t = step_time(SMALL, train, cpu, two_d)
    assert t.comm_cpu_s == pytest.approx(sum(moved.values()) * 1e-9) == pytest.approx(comm_cpu_s(moved, cpu))
    work = t.compute_s + t.dispatch_s + t.fsdp_host_s + t.optimizer_s
    assert t.busy_s == pytest.approx(2 * (work + t.comm_cpu_s) + t.dp_calls_s)
    assert t.total_s - t0.total_s == pytest.approx(2 * t.comm_cpu_s - (t0.busy_s - 2 * work - t0.dp_calls_s))
    # a quarter of the cores: each core's ranks double, and so does the bytes' CPU on it
    quarter = dataclasses.replace(cpu, cores_per_node=1)
    assert step_time(SMALL, train, quarter, two_d).busy_s - 4 * work == pytest.approx(
        4 * t.comm_cpu_s + t.dp_calls_s)
    # where the contended wall price is the longer, it stands alone: the CPU is in it, not added to it
    slow = Cluster(**{**CPU4, "intra_node_bw": 1e8}, cores_per_node=2)
    assert step_time(SMALL, train, dataclasses.replace(slow, gloo_byte_s=1e-9), two_d).total_s == \
        pytest.approx(step_time(SMALL, train, slow, two_d).total_s)
    # a core each: the critical path as before
    own = Cluster(**CPU4, cores_per_node=4)
    assert step_time(SMALL, train, dataclasses.replace(own, gloo_byte_s=1e-9), two_d).total_s == \
        step_time(SMALL, train, own, two_d).total_s
    # GPUs: NCCL's work is the device's and the network's, not the host's
    gpu = Cluster(nodes=1, devices_per_node=4, **H100)
    priced = step_time(SMALL, train, dataclasses.replace(gpu, gloo_byte_s=1e-9), two_d)
    assert priced.comm_cpu_s == 0.0 and priced.total_s == step_time(SMALL, train, gpu, two_d).total_s


def test_a_calibration_files_gloo_cpu_per_byte_is_what_the_cluster_prices_with(tmp_path):
    from elastictrain.planner.cluster import CPU_DEFAULTS, GPU_DEFAULTS, with_calibration

    base = Cluster(nodes=1, devices_per_node=4, device_memory=8 * GIB, **CPU_DEFAULTS, cores_per_node=2)
    assert base.gloo_byte_s and GPU_DEFAULTS["gloo_byte_s"] is None
    (tmp_path / "cal.json").write_text('{"gloo_byte_s": 7e-10}')
    assert with_calibration(base, tmp_path / "cal.json").gloo_byte_s == 7e-10
    with pytest.raises(Exception, match="gloo_byte_s must be a number >= 0"):
        dataclasses.replace(base, gloo_byte_s=-1.0)


def test_the_compute_probe_is_the_jobs_whole_model_up_to_12_blocks_timed_by_the_clock_given():
    """``--calibrate``'s FLOP/s and optimizer figures come from the job's own model, not one block of it (a
    model's rate falls with its depth on CPU: the benchmark's 12-block GPT ran at 76-79 GFLOP/s where one
    block ran at 89-95), timed by the clock the caller names (CPU time with one thread per worker: four
    processes on two cores gave rank 0 59.5 GFLOP/s by the wall clock times two, 89 by CPU time). A clock that
    ticks one second per reading makes each timed stretch one second: the figures are then the probe's FLOPs
    and one over its parameters."""
    from elastictrain import build_config
    from elastictrain.planner.calibrate import COMPUTE_PROBE_BLOCKS, job_compute_figures
    from elastictrain.planner.job import model_shape
    from elastictrain.planner.steptime import step_flops
    from elastictrain.task import builtin_task
    from tests.conftest import job

    def ticks():
        t = iter(range(10**6))
        return lambda: float(next(t))

    for layers, probed in ((3, 3), (COMPUTE_PROBE_BLOCKS + 2, COMPUTE_PROBE_BLOCKS)):
        spec = job(task={**job()["task"], "model": {**job()["task"]["model"], "n_layer": layers}})
        cfg = build_config(spec)
        cut = build_config(job(task={**job()["task"], "model": {**job()["task"]["model"], "n_layer": probed}}))
        mb = cfg.train.micro_batch
        flops = step_flops(model_shape(cut), Training(global_batch=mb, micro_batch=mb), Candidate(micro_batch=mb))
        params = sum(t.numel() for t in builtin_task(cut).model_fn().parameters())
        rate, per_param = job_compute_figures(cfg.model_dump(mode="json"), seconds=0.0, clock=ticks())
        assert rate == pytest.approx(flops) and per_param == pytest.approx(1.0 / params)


def test_a_gpu_cluster_is_sized_from_rays_accelerator_type_and_an_unknown_one_is_not_guessed(tmp_path):
    """Issue 36: from_ray(use_gpu=True) priced every GPU at 80 GiB and 400 TFLOP/s. Now the device comes from
    Ray's accelerator_type resource through the device table (H200: 141 GiB), mixed nodes take the smaller,
    and a type the table does not know (or none) is marked unknown: plan: auto refuses it, naming both fixes,
    until --gpu-memory-gb or a calibration gives the memory."""
    import json

    from elastictrain.devices import lookup
    from elastictrain.planner import cluster as clusters

    h200 = clusters.gpu_cluster([{"CPU": 16, "GPU": 8, "accelerator_type:H200": 1}] * 2 + [{"CPU": 4}])
    assert (h200.nodes, h200.devices_per_node, h200.device_known) == (2, 8, True)
    assert h200.device_memory == 141 * GIB and h200.flops == pytest.approx(989e12 * 0.4)
    assert "H200" in h200.source and clusters.unknown_device_refusal(h200) is None
    mixed = clusters.gpu_cluster([{"GPU": 8, "accelerator_type:H200": 1}, {"GPU": 4, "accelerator_type:A100-40G": 1}])
    assert (mixed.devices_per_node, mixed.device_memory, mixed.flops) == (4, 40 * GIB, pytest.approx(312e12 * 0.4))
    for resources in ({"GPU": 8}, {"GPU": 8, "accelerator_type:T4": 1}):
        unknown = clusters.gpu_cluster([resources])
        assert not unknown.device_known
        why = clusters.unknown_device_refusal(unknown)
        assert why and "parallel.calibration" in why and "--gpu-memory-gb" in why
    assert clusters.with_flags(unknown, gpu_memory_gb=16).device_known
    calib = tmp_path / "c.json"
    calib.write_text(json.dumps({"device_memory": 16 * GIB, "flops": 1e14}))
    assert clusters.with_calibration(unknown, calib).device_known
    calib.write_text(json.dumps({"flops": 1e14}))  # measured speed but no memory: still a guess
    assert not clusters.with_calibration(unknown, calib).device_known
    with pytest.raises(clusters.ClusterError, match="no GPU node"):
        clusters.gpu_cluster([{"CPU": 4}])
    assert lookup("NVIDIA H100 80GB HBM3").bf16_flops == 989e12 and lookup("Tesla T4") is None


def test_context_parallel_is_priced_activations_over_cp_and_kv_all_gathers():
    """cp = C: a rank holds T / C positions, so every activation term is at T / C, plus per block the keys
    and values gathered from the other cp ranks and the causal mask (the gathered K/V dominate the
    difference at 2K tokens: cp2's activations are 0.5x cp1's + K/V); FSDP shards the state over dp_shard x
    cp; the K/V all-gather moves 2 (C-1)/C B T kv_width bytes per block forward, again backward (a
    reduce-scatter of their gradient), again when checkpointing recomputes the forward; compute per rank
    is 1/C; and `plan` searches cp only when every axis is asked for (--all-axes)."""
    from elastictrain.planner.memory import activation_bytes, cp_attention_bytes, cp_mask_bytes, state_shards
    from elastictrain.planner.steptime import collective_calls, cp_bytes, moved_bytes, step_flops

    model = ModelShape(layers=4, hidden=1024, heads=8, seq_len=2048, vocab=256)
    train = Training(global_batch=8, micro_batch=1)
    gpu = Cluster(nodes=1, devices_per_node=8, **H100)
    one, two = Candidate(dp_replicate=2, micro_batch=1), Candidate(dp_replicate=2, cp=2, micro_batch=1)
    kv = 2 * 1 * 2048 * 1024 * train.activation_bytes  # K and V of the whole sequence, all heads
    assert cp_attention_bytes(model, train, one) == 0
    assert cp_attention_bytes(model, train, two) == pytest.approx(kv / 2)  # (C-1)/C of K and V, per block
    assert cp_mask_bytes(model, train, two) == 1024 * 2048 * 4 and cp_mask_bytes(model, train, one) == 0
    assert block_activation_bytes(model, train, two) == pytest.approx(
        block_activation_bytes(model, train, one) / 2 + cp_attention_bytes(model, train, two))
    ratio = activation_bytes(model, train, two) / activation_bytes(model, train, one)
    assert 0.5 < ratio <= 0.6, ratio  # the benchmark's target (benchmarks/parallel.py's cp rows)
    assert cp_bytes(model, train, gpu, one) == 0
    assert cp_bytes(model, train, gpu, two) == pytest.approx(2 * (1 / 2) * kv)  # gathered forward, scattered back
    recomputed = Candidate(dp_replicate=2, cp=2, micro_batch=1, activation_checkpointing=True)
    assert cp_bytes(model, train, gpu, recomputed) == pytest.approx(3 * (1 / 2) * kv)
    per_step = model.layers * 4  # blocks x micro-batches (global 8 over 2 data ranks of 1)
    assert moved_bytes(model, train, gpu, two)["cp"] == pytest.approx(per_step * cp_bytes(model, train, gpu, two))
    assert step_flops(model, train, two) == pytest.approx(step_flops(model, train, one) / 2)
    assert state_shards(Candidate(dp_shard=2, cp=2)) == 4 and state_shards(two) == 1
    groups = {(w, size) for w, _, size, _ in collective_calls(model, train, gpu, two).groups}
    assert groups >= {("cp", 2), ("replicate", 4)}  # DDP's group: dp_replicate x cp
    assert step_time(model, train, gpu, two).cp_s > 0 and step_time(model, train, gpu, one).cp_s == 0
    asked = rank_layouts(model, train, gpu, 4, runnable_only=False)
    assert {e.candidate.cp for e in asked} == {1, 2, 4} and all(e.runnable for e in asked)
    assert {e.candidate.cp for e in rank_layouts(model, train, gpu, 4)} == {1}
