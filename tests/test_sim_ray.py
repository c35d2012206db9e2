"""The Ray variant of the simulation (elastictrain/sim/ray_actors.py, ray_run.py): the real controller over
Ray drives 16 lightweight actors (``num_cpus=0``, no torch in their processes); a real SIGKILL of one
actor's process is recovered (the world of 15 steps slower, ``degraded_step_s``, so the replacement's start
falls inside it however loaded the machine: the grow-back cuts it short) and the run finishes its steps with
the world sizes the policy promises, with one ``join`` per member and generation and no ``sync`` round
(counted; each member's ``run`` goes right behind its ``join``: tests/test_sim.py counts that). Correctness
only: no timing is asserted (``benchmarks/scale.py --ray-actors N`` has the figures).

On the session's multi-node ``cluster`` (tests/cluster_fixtures.py), not the session's local Ray: the local
Ray's workers preload the worker actor's module (torch), and the point here is an actor process without it;
the cluster's nodes preload nothing (a Ray of its own would cost a start: GCS, raylet, agents)."""

from __future__ import annotations

from elastictrain.sim.ray_run import run_ray_actors
from elastictrain.sim.scenarios import promised_worlds, sim_config

# ten simulated seconds at full size; the world of 15 steps every 0.25 s: 95 s for the replacement to start
# (a Ray worker process importing Ray, no torch), cut short when it joins
ACTORS, STEPS, STEP_S, DEGRADED_S = 16, 400, 0.025, 0.25


def test_16_actors_recover_a_sigkill_and_finish_with_the_promised_world_sizes(cluster) -> None:
    r = run_ray_actors(ACTORS, steps=STEPS, step_s=STEP_S, kill_at=20, degraded_step_s=DEGRADED_S)
    assert not r.torch_in_actor
    assert (r.state, r.steps, r.lost_steps) == ("finished", STEPS, 0), r
    assert r.worlds == promised_worlds(sim_config(ACTORS, STEPS, STEP_S), [16, 15, 16]) == [16, 15, 16], r
    assert r.kill_to_generation_s is not None and r.kill_to_next_step_s is not None, r  # the kill came mid-run
    # one round of calls per generation for the rendezvous and the state: `join` syncs (no `sync` round)
    calls = r.extra["calls"]
    assert calls["join"] == sum(r.worlds) and "sync" not in calls and calls["open_store"] == len(r.worlds), calls
    # the recovery's phases were traced, in the protocol's order (benchmarks/scale.py prints them); the
    # first step may end before the driver has taken every join's answer (the runs were already out)
    p = r.extra["phases"]
    order = ["state_recovering", "drain_runs<", "failure_event", "decision", "opening_the_rendezvous_store:answered",
             "join:answered", "generation_started"]
    assert [p[k] for k in order] == sorted(p[k] for k in order), p
    assert p["opening_the_rendezvous_store:answered"] < p["next_step_end"], p
    assert "process_gone" in p and "ray_death_notice" in p and p["watch_waiting"] < p["state_recovering"], p
    assert r.extra["growth"].keys() >= {"growth_spawned", "growth_ready", "growth_resized"}, r.extra["growth"]
