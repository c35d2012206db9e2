"""The simulated cluster drives the real controller (elastictrain/sim): its numbers are what the policy
promises (steps run, steps lost, world-size history), and what the driver does per poll interval does not
grow with the rank count. Correctness only: no timing is asserted (benchmarks/scale.py has the figures)."""

from __future__ import annotations

import random
import statistics

import pytest

from elastictrain.controller import policy
from elastictrain.controller.ledger import Ledger
from elastictrain.controller.monitor import POLL_SWEEP
from elastictrain.events import EventLog, read_events
from elastictrain.parallel.layout import LayoutSpec, valid_world_sizes
from elastictrain.sim.scenarios import promised_worlds, run_scenario, sim_config
from elastictrain.worker.loop import StepRecord

STEP_S = 0.01  # simulated: a hundred steps take a second
STEPS = 300  # the fault comes at step 50: the rest leaves time to recover and grow back on a loaded machine


# The world sizes each scenario at 64 ranks must go through, written out (not asked of the policy under test):
# sim_config's global batch 2,882,880 = 2^6 3^2 5 7 11 13 divides by every size here, so elastic mode runs
# every worker left (a kill or a hang: one rank, 63; a node: its 8 ranks, 56; 2% of 64: one rank), then grows
# back to all 64.
WORLDS_64 = {"steady": [64], "kill": [64, 63, 64], "node": [64, 56, 64], "hang": [64, 63, 64],
             "lose2pct": [64, 63, 64]}


@pytest.mark.parametrize("scenario", ["steady", "kill", "node", "hang", "lose2pct"])
def test_a_simulated_run_at_64_ranks_keeps_what_the_policy_promises(scenario: str) -> None:
    r = run_scenario(scenario, 64, steps=STEPS, step_s=STEP_S)
    assert sim_config(64, STEPS, STEP_S).train.global_batch == 2_882_880  # the divisibility the table assumes
    assert r.state == "finished" and r.steps == STEPS
    assert r.lost_steps == 0  # survivors hold the newest state: the step in flight is lost time, not a step
    assert r.worlds == WORLDS_64[scenario], r


def test_a_drain_notice_for_5_percent_of_the_nodes_preempts_at_a_step_boundary() -> None:
    r = run_scenario("preempt", 64, steps=STEPS, step_s=STEP_S)
    assert r.state == "preempted" and r.worlds == [64] and 50 <= r.steps < STEPS, r
    # the decision is timed from the controller's read of the notice; the wait for that read (its check
    # once per poll interval) is reported beside it: together they make the time from the fault
    notice = r.extra["fault_to_notice_s"]
    assert abs(notice + r.fault_to_decision_s - r.fault_to_detect_s) < 1e-3, r


def test_at_1000_ranks_a_kill_shrinks_to_the_promised_size_and_grows_back() -> None:
    r = run_scenario("kill", 1000, steps=STEPS, step_s=STEP_S)
    config = sim_config(1000, STEPS, STEP_S)
    assert (r.state, r.steps, r.lost_steps) == ("finished", STEPS, 0)
    assert r.worlds == promised_worlds(config, [1000, 999, 1000]) == [1000, 990, 1000], r


def test_at_1000_ranks_a_hang_blames_the_hung_rank_alone() -> None:
    """The sweep leaves most members' last phase stale (polled seconds ago): the watchdog must judge only
    views asked after the stall began, or it blames healthy ranks "computing" since before it."""
    r = run_scenario("hang", 1000, steps=STEPS, step_s=STEP_S)
    assert (r.state, r.steps, r.lost_steps) == ("finished", STEPS, 0)
    assert r.worlds == [1000, 990, 1000], r  # 999 available -> 990 (the policy's), then back


def test_the_driver_polls_rank_0_and_a_bounded_sweep_not_every_rank() -> None:
    """Before: every member was polled every interval (1,000 polls per half second here). Now: rank 0 and
    POLL_SWEEP others per interval, every member only when a generation forms or ends."""
    r = run_scenario("steady", 1000, steps=200, step_s=STEP_S)  # two seconds: a few poll intervals
    calls = r.extra["calls"]
    intervals = calls["poll_running_rank0"]  # rank 0 is asked once an interval while the generation trains
    assert intervals >= 2 and calls["poll_running"] <= intervals * (POLL_SWEEP + 1), calls


def _pairwise(compute_times: dict[int, list[float]], factor: float, window: int) -> dict[int, str]:
    """The rule as first written (O(N^2)): each rank against the median of the others."""
    medians = {r: statistics.median(ts[-window:]) for r, ts in compute_times.items() if len(ts) >= window}
    out = {}
    for rank, med in medians.items():
        base = statistics.median([m for r, m in medians.items() if r != rank]) if len(medians) > 1 else 0
        if base > 0 and med > factor * base:
            out[rank] = med
    return out


@pytest.mark.parametrize("seed", range(20))
def test_stragglers_found_by_sorted_medians_are_the_pairwise_ones(seed: int) -> None:
    rng = random.Random(seed)
    times = {r: [rng.choice([1.0, 1.0, 1.1, 2.5, 4.0]) * rng.uniform(0.9, 1.1) for _ in range(rng.randint(3, 9))]
             for r in range(rng.randint(2, 40))}
    assert set(policy.find_stragglers(times, 2.0, 4)) == set(_pairwise(times, 2.0, 4))


@pytest.mark.parametrize("seed", range(10))
def test_membership_searched_downwards_is_the_largest_valid_size(seed: int) -> None:
    rng = random.Random(seed)
    spec = LayoutSpec("ddp", rng.choice([720, 1000, 4096, 5040]), rng.choice([1, 2, 4]))
    top = rng.randint(8, 300)
    for available in range(0, top + 3):
        d = policy.decide_membership(available=available, current=top, mode="elastic", min_workers=1,
                                     max_workers=top, global_batch=spec.global_batch, micro_batch=spec.micro_batch,
                                     waiting_since=None, now=0.0, wait_limit_s=60.0, spec=spec)
        fits = [w for w in valid_world_sizes(spec, top) if w <= available]
        assert (d.action, d.world_size) == (("go", max(fits)) if fits else ("wait", d.world_size))


def test_the_reporting_ranks_record_completes_a_step_other_ranks_feed_only_stragglers(tmp_path) -> None:
    ledger = Ledger(EventLog(tmp_path, console=None), total_steps=10, global_batch=8, max_workers=1000)
    ledger.new_generation(0, 1000, 1)

    def rec(step: int, compute: float = 0.1) -> StepRecord:
        return StepRecord(step, 1.0, 1000, 1, 0.2, compute, 100.0 + step)

    ledger.add(7, rec(1, 0.5), complete=False)  # another rank first: no step yet
    assert ledger.last_step == 0
    ledger.add(0, rec(1), complete=True)  # rank 0's record: the step completed on all 1,000 ranks
    ledger.add(0, rec(2), complete=True)
    assert ledger.last_step == 2 and list(ledger.compute_times[7]) == [0.5]
    ledger.add(3, rec(3), complete=False)  # rank 0 died before reporting step 3: kept as partial
    ledger.flush_partial()
    steps = [e for e in read_events(tmp_path) if e["event"] == "step"]
    assert [(e["step"], e.get("complete", True)) for e in steps] == [(1, True), (2, True), (3, False)]


def test_only_a_save_of_the_current_generation_keeps_every_rank_polled(tmp_path) -> None:
    from types import SimpleNamespace

    from elastictrain.controller.commits import Committer

    c = Committer(sim_config(4, 10, STEP_S), EventLog(tmp_path, console=None), None, {})
    try:
        c.new_generation(0, 4)
        c.take(0, SimpleNamespace(step=10, generation=0, rank=0))  # 1 of 4 reports: the save waits
        assert c.waiting()
        c.new_generation(1, 3)  # a rank died: that save is abandoned, nobody's reports are awaited
        assert not c.waiting()
    finally:
        c.close()


def test_the_driver_freezes_what_lives_as_long_as_the_run_and_unfreezes_at_the_end() -> None:
    """A full collection at 10,000 ranks walked every long-lived object (130-225 ms a time, one landing in
    a recovery doubled its decision time); frozen after the start, it costs ~10 ms."""
    import gc

    from elastictrain.sim import scenarios

    seen: list[int] = []
    orig = scenarios.Controller

    class Watched(orig):  # the real controller; records the frozen count while it runs
        def step(self) -> None:
            super().step()
            seen.append(gc.get_freeze_count())

    scenarios.Controller = Watched
    try:
        r = run_scenario("steady", 64, steps=20, step_s=STEP_S)
    finally:
        scenarios.Controller = orig
    assert r.state == "finished" and seen and seen[-1] > 0, seen[-5:]
    assert gc.get_freeze_count() == 0


def _sim_run(tmp_path, ranks: int, steps: int, scenario: str, step_s: float = STEP_S):
    """The real controller over ``ranks`` simulated workers with ``scenario``'s faults, not yet run:
    (controller, world, event log); a test hooks the world or the log, then calls ``run()``."""
    from elastictrain.controller.controller import Controller
    from elastictrain.sim.group import SimGroup
    from elastictrain.sim.scenarios import _faults
    from elastictrain.sim.world import SimWorld
    from elastictrain.task import builtin_task

    config = sim_config(ranks, steps, step_s)
    world = SimWorld(step_s=step_s, setup_s=5 * step_s)
    world.faults = _faults(scenario, ranks, world, random.Random(0))
    events = EventLog(tmp_path, console=None)
    return Controller(config, builtin_task(config), events, group=SimGroup(world, ranks)), world, events


def test_a_recovery_sends_each_member_one_join_and_its_run_in_one_round_nothing_else(tmp_path) -> None:
    """After the decision a recovery pays rounds of calls over every member, each a round trip through the
    cluster (0.1-0.2 s each at 126 Ray actors on this machine). Before: a poll of every member, ``join``,
    ``sync``, ``run``; then ``join`` (which syncs from the source known before the rendezvous: the
    survivors hold the state) and, once every join answered, ``run``. Now each member's ``run`` goes right
    behind its ``join``, before any join answered, its own join's call as argument (Ray starts it after
    that join): one round. Nobody is polled again (rank 0's last records were taken before the decision)."""
    from collections import Counter

    c, world, events = _sim_run(tmp_path, 64, 120, "kill")
    marks: dict[str, Counter] = {}
    behind: list[bool] = []  # per run: sent with its own member's join as argument, that join not taken yet
    taken: dict[int, object] = {}  # (the refs kept: an id is not reused)
    result = world._result

    def take(ref):
        if ref.kind == "synced":
            taken[id(ref)] = ref
        return result(ref)

    def run_of(worker, orig):
        def run(target, joined=None):
            behind.append(joined is not None and joined.worker is worker and id(joined) not in taken)
            return orig(target, joined)
        return run

    spawn = world.spawn

    def spawned(slot):
        w = spawn(slot)
        w._run = run_of(w, w._run)
        return w

    world.spawn, world._result = spawned, take

    def on_event(r: dict) -> None:
        if r["event"] == "failure" and "failure" not in marks:  # accounted, just before the decision
            marks["failure"] = Counter(world.calls)
        elif r["event"] == "generation_started" and "failure" in marks and "formed" not in marks:
            marks["formed"], marks["world"] = Counter(world.calls), Counter(n=r["world_size"])

    events.listeners.append(on_event)
    c.run()
    events.close()
    assert c.sm.state.value == "finished", c.final_error
    during = marks["formed"] - marks["failure"]
    n = marks["world"]["n"]
    assert dict(during) == {"open_store": 1, "join": n, "run": n}, during  # the runs went before the start
    assert behind and all(behind), behind  # every generation's: behind its own join, before its answer


class _Ref:
    def __init__(self, value: int, dead: bool) -> None:
        self.value, self.dead = value, dead


class _CountingRuntime:
    """``get`` as Ray's: the values of a list, or the first failed call's error."""

    def __init__(self) -> None:
        self.gets = 0

    def get(self, refs, timeout=None):
        self.gets += 1
        for r in refs:
            if r.dead:
                raise RuntimeError(f"actor {r.value} died")
        return [r.value for r in refs]


def test_get_each_takes_results_in_few_gets_and_isolates_each_failed_call() -> None:
    from elastictrain.controller.runtime import GET_CHUNK, get_each

    dead = set(range(4000, 4008)) | {9999}  # a lost node's ranks together, and one more apart
    refs = [_Ref(i, i in dead) for i in range(10000)]
    rt = _CountingRuntime()
    out = get_each(rt, refs)
    assert [v for v, e in out if e is None] == [i for i in range(10000) if i not in dead]
    assert [str(e) for v, e in out if e is not None] == [f"actor {i} died" for i in sorted(dead)]
    chunks = -(-10000 // GET_CHUNK)
    # per chunk holding failures, two gets per halving down to each failed call (2 x log2(GET_CHUNK) per
    # group of failures): ~60 here, not 10,000
    assert rt.gets <= chunks + 2 * 2 * (GET_CHUNK.bit_length() + 1), rt.gets
    rt = _CountingRuntime()
    assert get_each(rt, [_Ref(i, False) for i in range(3000)]) == [(i, None) for i in range(3000)]
    assert rt.gets == -(-3000 // GET_CHUNK)


def test_a_lost_node_at_1024_ranks_is_decided_on_a_few_gets_not_one_per_rank(tmp_path) -> None:
    """A failed step ends every member's ``run``; the controller used to take each result with its own
    ``get`` (a round trip each through Ray: 10,000 at 10,000 ranks, ~30 ms of the decision in the
    simulator alone). It takes them in chunks: from the fault to the decision, a few dozen ``get``."""
    ranks = 1024
    c, world, events = _sim_run(tmp_path, ranks, 80, "node")
    gets = {"n": 0, "at_fault": None, "at_decision": None}
    get = world.get

    def counted(refs, *, timeout=None):
        gets["n"] += 1
        return get(refs, timeout=timeout)

    world.get = counted

    def on_event(r: dict) -> None:
        if r["event"] == "failure" and gets["at_decision"] is None:
            gets["at_decision"] = gets["n"]

    events.listeners.append(on_event)
    apply = world.faults[0].apply

    def marked(w, t):
        gets["at_fault"] = gets["n"]
        apply(w, t)

    world.faults[0].apply = marked
    c.run()
    events.close()
    assert c.sm.state.value == "finished", c.final_error
    taken = gets["at_decision"] - gets["at_fault"]
    assert taken <= 64, f"{taken} gets from the fault to the failure event at {ranks} ranks"


class _Gone:
    """A simulated group that answers ``process_gone`` (the controller's look at a member's process on
    its node) and counts the looks."""

    def __init__(self, world) -> None:
        self.world, self.looks = world, 0

    def __call__(self, slot) -> bool:
        self.looks += 1
        return self.world.workers[slot.index].dead_at is not None


def test_survivors_failed_step_sends_no_look_for_the_dead_once_a_death_is_known(tmp_path) -> None:
    """A failed step ends every survivor's ``run`` with ``peer_failed``; the controller used to look at
    every member's process for the dead one (a /proc read each on Ray's node: 256 looks here) even when
    Ray's notice had named it in the same pass. Now it looks only while no death is known."""
    c, world, events = _sim_run(tmp_path, 256, 80, "kill")
    gone = c.group.process_gone = _Gone(world)
    c.run()
    events.close()
    assert c.sm.state.value == "finished", c.final_error
    failures = [e for e in read_events(tmp_path) if e["event"] == "failure"]
    assert [(f["slot"], f["reason"]) for f in failures] == [(131, failures[0]["reason"])], failures
    assert "worker process died" in failures[0]["reason"]
    assert gone.looks == 0


def test_when_the_peers_tell_before_rays_notice_the_dead_member_is_looked_for(tmp_path) -> None:
    """The other side: Ray's notice of the death is late (the dead member's call never resolves here), the
    survivors' ``peer_failed`` comes first: the controller looks at the members' processes and fails the
    dead one as seen by its peers, without waiting for Ray."""
    c, world, events = _sim_run(tmp_path, 64, 80, "kill")
    gone = c.group.process_gone = _Gone(world)
    end_of = world.end_of

    def late_notice(ref):  # a dead member's run call: Ray has not told yet
        if ref.kind == "run" and ref.worker.dead_at is not None:
            return float("inf")
        return end_of(ref)

    world.end_of = late_notice
    c.run()
    events.close()
    assert c.sm.state.value == "finished", c.final_error
    failures = [e for e in read_events(tmp_path) if e["event"] == "failure"]
    assert [(f["slot"], f["reason"]) for f in failures] == [(35, "worker process died (seen by its peers)")]
    assert 0 < gone.looks <= 2 * 63, gone.looks  # one pass over the members per batch of peer_failed


def test_the_membership_decision_tries_sizes_without_listing_every_valid_size(monkeypatch) -> None:
    """The decision searches sizes downwards from what is available (10,000 -> 9,999 -> ... 9,900 after a
    kill: 100 tries). Each invalid try went through ``check_layout``, whose error lists every valid world
    size up to 10,000 (9,795 listings here, ~4 ms of the decision). The rule is checked first: none."""
    import elastictrain.data.cursor as cursor

    calls = {"n": 0}
    listing = cursor.valid_world_sizes

    def counted(*a, **k):
        calls["n"] += 1
        return listing(*a, **k)

    monkeypatch.setattr(cursor, "valid_world_sizes", counted)
    config = sim_config(10000, 10, STEP_S)
    assert promised_worlds(config, [9999]) == [9900]
    assert calls["n"] == 0


def test_survivors_results_after_the_kill_send_no_look_for_the_dead(tmp_path) -> None:
    """As on Ray: the dead member's call ends first (its actor's death), the controller kills it and drains
    the survivors, whose ``peer_failed`` results come only then. The failure is known (killed, dropped from
    the calls): no member's process is looked at (63 looks here before)."""
    c, world, events = _sim_run(tmp_path, 64, 80, "kill")
    gone = c.group.process_gone = _Gone(world)
    watch = world.watch

    class DeathsFirst:  # a batch with a death tells the death alone; the rest come with the next wait
        def __init__(self, refs) -> None:
            self.inner, self.held = watch(refs), []

        def wait(self, timeout: float):
            got, self.held = self.held + self.inner.wait(timeout), []
            dead = [r for r in got if r.worker.dead_at is not None]
            self.held = [r for r in got if r.worker.dead_at is None] if dead else []
            return dead or got

    world.watch = DeathsFirst
    c.run()
    events.close()
    assert c.sm.state.value == "finished", c.final_error
    failures = [e for e in read_events(tmp_path) if e["event"] == "failure"]
    assert [f["slot"] for f in failures] == [35] and "worker process died" in failures[0]["reason"]
    assert gone.looks == 0


def test_a_death_the_run_watch_tells_sends_no_round_of_polls_before_the_decision(tmp_path) -> None:
    """The interval that learns of a death used to send its usual polls (rank 0 and a sweep of 64) before
    looking at the ended calls; the recovery then waited for every one of them (a round trip each to a
    member on its way out of the failed step: on 128 Ray actors sharing two cores, part of the 0.1-0.3 s
    from the first ended call to the failure). Now the ended calls are taken first and, once they tell a
    failure, the interval ends there: between the watch's news and the decision the only poll is rank
    0's own (its last records say which steps completed)."""
    from collections import Counter

    c, world, events = _sim_run(tmp_path, 128, 80, "kill")
    marks: dict[str, Counter] = {}
    watch = world.watch

    class Told:  # the calls made up to the first wait that returned an ended call after the fault
        def __init__(self, refs) -> None:
            self.inner = watch(refs)

        def wait(self, timeout: float):
            got = self.inner.wait(timeout)
            if got and world.faults[0].at is not None and "told" not in marks:
                marks["told"] = Counter(world.calls)
            return got

    def on_event(r: dict) -> None:
        if r["event"] == "failure" and "failure" not in marks:  # accounted, just before the decision
            marks["failure"] = Counter(world.calls)

    world.watch = Told
    events.listeners.append(on_event)
    c.run()
    events.close()
    assert c.sm.state.value == "finished", c.final_error
    during = marks["failure"] - marks["told"]
    assert during["poll"] == 1, during


def test_a_poll_answered_before_a_members_run_ended_does_not_describe_it_after(tmp_path, monkeypatch) -> None:
    """A member's poll answered before its ``run`` ended can be taken after the run's result: the interval
    that learns of a death takes the ended calls first and stops there, and the recovery takes the polls
    still out. The poll's step is then older than the result's, and it used to overwrite it: a survivor
    described at an older step than it holds (under tp2 x dp2 on 4 loaded ranks, a survivor at step 4
    among survivors at 5 left a tp coordinate uncovered, and the run restarted from scratch). Here one
    survivor's polls are answered at the moment of the kill with the step it had when asked; the decision
    must see it at the step its ``run`` ended at, like every other survivor."""
    from elastictrain.controller import sources
    from elastictrain.sim import world as sim_world

    ranks = 16
    # steps of 20 ms: the kill (mid-step 51) comes ~1 s in, after a poll interval or two (0.5 s) in which
    # every member was asked (a sweep), so the late survivor's poll carries a step well before the kill's
    c, world, events = _sim_run(tmp_path, ranks, 80, "kill", step_s=0.02)
    late = 1  # a survivor (the kill takes slot ranks // 2 + 3), swept by the polls each interval
    answered_late = []
    poll = sim_world.SimWorker._poll

    def late_poll(self, after=None):  # noqa: ANN001, ANN202
        ref = poll(self, after)
        fault = world.faults[0]
        if self.slot == late and ref.kind == "value" and fault.at is None:
            due = world._fault_time(fault)
            if due != float("inf"):
                ref.created = max(ref.created, due)  # the answer (its step when asked) arrives with the kill
                answered_late.append(ref.value["step"])
        return ref

    seen: list[dict[int, int]] = []
    rank_sources = sources.rank_sources

    def spy(**kw):  # noqa: ANN003, ANN202
        seen.append(dict(kw["survivors"]))
        return rank_sources(**kw)

    monkeypatch.setattr(sim_world.SimWorker, "_poll", late_poll)
    monkeypatch.setattr(sources, "rank_sources", spy)
    c.run()
    events.close()
    assert c.sm.state.value == "finished", c.final_error
    survivors = seen[0]  # the recovery's decision (generation 0: rank = slot)
    assert late in survivors and survivors[late] == max(survivors.values()), (survivors, answered_late)
    # the case the test is about happened: a poll answered late carried an older step than the one the
    # survivor's run ended at (on a loaded machine the sweep's polls may come later: any older step will do)
    assert answered_late and min(answered_late) < survivors[late], (answered_late, survivors[late])


def test_the_peer_tier_runs_in_the_simulator_with_the_worlds_own_keepers(tmp_path) -> None:
    """The peer tier's keepers are started through the Runtime (controller/runtime.py), so the simulator
    gives the controller its own (sim/world.py SimKeeper) instead of switching the tier off: one keeper per
    node, sized, attached to every member of every generation, asked at the failure, killed at the end."""
    from elastictrain.controller.controller import Controller
    from elastictrain.sim.group import SimGroup
    from elastictrain.sim.scenarios import _faults
    from elastictrain.sim.world import SimWorld
    from elastictrain.task import builtin_task

    ranks = 64
    config = sim_config(ranks, 60, STEP_S, memory_every_steps=5)
    world = SimWorld(step_s=STEP_S, setup_s=5 * STEP_S)
    world.faults = _faults("kill", ranks, world, random.Random(0))
    c = Controller(config, builtin_task(config), EventLog(tmp_path, console=None), group=SimGroup(world, ranks))
    summary = c.run()
    assert summary["state"] == "finished", c.final_error
    nodes = {w.node for w in world.workers.values()}
    assert sorted(k.node for k in world.keepers) == sorted(nodes) and all(k.killed for k in world.keepers)
    gens = [e for e in read_events(tmp_path) if e["event"] == "generation_started"]
    assert len(gens) >= 2 and world.calls["attach_keeper"] == sum(g["world_size"] for g in gens)
    assert world.calls["keeper_set_budget"] == len(nodes) * len(gens)  # sized at each generation
    assert world.calls["keeper_catalog"] >= len(nodes)  # asked for its snapshots at the failure


def test_the_simulated_step_record_has_every_field_the_real_one_has() -> None:
    """The controller reads step records of both kinds: a field the real record gains and the simulated one
    lacks ends every simulated run with an AttributeError (tokens_per_expert did)."""
    from dataclasses import fields

    from elastictrain.sim.ray_actors import Record
    from elastictrain.worker.loop import StepRecord

    assert {f.name for f in fields(StepRecord)} <= {f.name for f in fields(Record)}
