"""A replacement that runs in a standby whose set-up ahead is done (``workers.standby``) starts at detection and
joins the recovery generation itself: the run does not shrink, as with a spare (no generation of the survivors
alone, no second rendezvous to grow back). One the standby cannot serve prebuilt starts once the survivors
train again and joins by growing, as before. The real controller against the simulated group
(elastictrain/sim), and against scripted workers on the session's Ray (the order of the take and the
formation); no timing is asserted."""

from __future__ import annotations

import pytest

from elastictrain.sim.scenarios import run_scenario

STEPS = 200
STEP_S = 0.01


@pytest.mark.parametrize("ranks", [8, 64])
def test_a_prebuilt_standby_joins_the_recovery_generation_and_the_run_never_shrinks(ranks: int) -> None:
    r = run_scenario("kill", ranks, steps=STEPS, step_s=STEP_S, prebuilt_standby=True)
    assert (r.state, r.steps, r.lost_steps) == ("finished", STEPS, 0), r
    # one generation after the failure, at full size (start, recover), never one rank fewer
    assert r.worlds == [ranks, ranks], r


def test_without_a_prebuilt_standby_the_run_shrinks_and_grows_back() -> None:
    r = run_scenario("kill", 8, steps=STEPS, step_s=STEP_S)
    assert (r.state, r.steps, r.lost_steps) == ("finished", STEPS, 0), r
    assert r.worlds == [8, 7, 8], r


def test_the_controller_takes_a_prebuilt_standby_before_it_forms_the_recovery_generation(tmp_path, ray_local) -> None:
    """The real controller against scripted workers on the session's Ray (test_controller_paths.py's fake
    group): slot 1 dies while a prebuilt standby would serve it, so its replacement is spawned at detection
    and the recovery generation forms with both slots (a cold one is spawned after the survivors'
    generation: test_replacement_starts_after_the_survivors_regroup_not_beside_their_recovery)."""
    import ray
    from test_controller_paths import ScriptedWorker, _controller, _step_until

    from elastictrain.controller.group import SlotState
    from elastictrain.controller.state import State

    c, group = _controller(tmp_path, {0: {"run": "peer_failed", "hold_run": True}, 1: {"run": "exit"}},
                           workers={"min": 1, "max": 2})
    order: list[tuple[str, int]] = []
    spawn, form = group.spawn, c._form_generation
    prebuilt = {"slot": None}  # which slot a prebuilt standby would serve now

    standby = ScriptedWorker.options(num_cpus=0).remote(1, {})  # its process up before the failure
    ray.get(standby.setup.remote(), timeout=180)

    def spawn_logged(index: int):
        order.append(("spawn", index))
        if index != prebuilt["slot"]:
            return spawn(index)
        slot = group.slots[index]  # the take: the standby's actor, set up with the slot
        slot.actor, slot.setup_ref = standby, standby.setup.remote()
        slot.state, slot.has_state, slot.rank, slot.info = SlotState.STARTING, False, None, {}
        return slot

    def form_logged(chosen, **kw):
        order.append(("formed", len(chosen)))
        return form(chosen, **kw)

    group.spawn, c._form_generation = spawn_logged, form_logged
    group.standby_prebuilt = lambda index: index == prebuilt["slot"]
    try:
        c.step()  # STARTING -> RUNNING at world 2
        assert c.sm.state is State.RUNNING and c.world_size == 2
        prebuilt["slot"] = 1
        _step_until(c, lambda: c.sm.state is State.RECOVERING)
        group.slots[0].actor.release.remote()  # the death is known: the survivor's step fails now
        before = len(order)
        c.step()  # RECOVERING: the replacement is taken first, then the generation forms at full size
        assert order[before:] == [("spawn", 1), ("formed", 2)], (order, c.sm.history)
        assert c.world_size == 2 and c.sm.state is State.RUNNING
    finally:
        group.shutdown()
