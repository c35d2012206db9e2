"""A replacement that runs in a standby whose set-up ahead is done (``workers.standby``) starts at detection and
joins the recovery generation itself: the run does not shrink, as with a spare (no generation of the survivors
alone, no second rendezvous to grow back). One the standby cannot serve prebuilt starts once the survivors
train again and joins by growing, as before. The real controller against the simulated group
(elastictrain/sim): no timing is asserted."""

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
