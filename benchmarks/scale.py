"""Control-plane scale benchmark: the real controller driving N simulated ranks (elastictrain/sim/).

Scenarios (each a whole run of the real Controller over a simulated cluster, one process, no Ray, no
training): ``steady`` (no fault), ``kill`` (one rank killed mid-step), ``node`` (a node of 8 ranks lost,
back 25 steps later: growth back), ``hang`` (one rank SIGSTOPped), ``preempt`` (a drain notice for 5% of
the nodes), ``lose2pct`` (2% of the ranks killed at once). Per scenario:

- ``driver_cpu_per_step_s``: the driver thread's CPU (``time.thread_time``) per training step in steady
  state, between its step events 5 and 49 (the fault comes at step 50); the fake workers answer in the
  driver's thread and count with it (building a poll's records stands for deserializing them);
  ``driver_busy``: that CPU over the wall time between the two events (near 1: the driver cannot keep up
  and falls behind the training);
- ``events_bytes_per_step``: events.jsonl growth per step in steady state;
- ``fault_to_detect_s``: from the injected fault to the controller's state change (RUNNING ->
  RECOVERING / CHECKPOINTING), on the driver's own clock: its CPU plus its waits for the cluster (this
  machine's load left out);
- ``fault_to_decision_s``: to the controller's decision, on the same clock. Per scenario: ``kill``,
  ``node``, ``lose2pct``, ``hang``: from the fault to its "recovery source" line (membership and recovery
  sources chosen: the survivors' failed step returned, rank 0's last records taken); a hang is bounded by
  the hang watchdog (wall time: read ``fault_to_decision_wall_s``). ``preempt``: from the controller's
  check of the drain watcher that read the notice to its decision to stop (the stop sent to every member,
  "-> CHECKPOINTING"; the members stay, the state is their own). Before that check the notice waits for
  it: the controller reads drain notices once per poll interval (0.5 s; on Ray the watcher also reads
  the GCS node table at most once a second), on purpose -- a drain comes with its node's deadline
  (minutes for a spot preemption) and the stop is planned two step boundaries ahead -- reported as
  ``fault_to_notice_s``, not hidden. ``fault_to_decision_wall_s``: from the fault itself, wall time;
- ``growth_s``: from the lost node's return to the generation back at full size;
- ``peak_mem_mb`` (``--memory``: tracemalloc peak of the whole run; slows the run down);
- ``decision_window`` (in ``extra``; printed under the scenario's line): what the machine did from the
  fault to the decision (elastictrain/sim/machine.py): the driver thread's CPU, its minor page faults and
  involuntary context switches, the CPU time the whole machine and this process were busy, steal, and
  garbage collections by generation -- to tell a slow run's cause (another process on the other core,
  fresh pages, the hypervisor) from the controller's work.

Usage::

    python benchmarks/scale.py --ranks 1000 [--json] [--scenarios steady,kill] [--step-s 0.02]
    python benchmarks/scale.py --ray-actors 128 [--json] [--steps 400] [--step-s 0.05]
    python benchmarks/scale.py --ray-get 10000   # what Ray charges the driver for 10,000 results
    python benchmarks/scale.py --ray-death 128   # Ray's part of learning of a death (plain actors)

``--json`` ends the output with one line: driver_cpu_per_step_s (steady), fault_to_decision_s (the
slowest scenario but the hang, whose bound is the watchdog's; each scenario's as defined above),
fault_to_notice_s (the drain notice's wait for the controller's check), events_bytes_per_step, and every
scenario's figures. Figures taken on a loaded machine are relative, not final.

``--ray-actors N``: the Ray variant instead (elastictrain/sim/ray_run.py): a local Ray, N lightweight
actors (``num_cpus=0``, no torch in their processes) driven by the real controller over Ray; at step 20
one actor's process is SIGKILLed by its pid. Prints ``kill_to_next_step_s`` (the SIGKILL to the end of
the next generation's first step, on the actors' clock; target < 1 s at 128 actors),
``kill_to_detect_s`` (to the controller's failure event: Ray's notice of the death),
``kill_to_generation_s`` (to the next generation's start: after the decision, ``open_store`` on rank 0
and ``join`` of every member, which also syncs the state; each member's ``run`` goes right behind its
``join``), ``calls`` (the controller's calls on the
actors, by method), the driver's view of that step
(``kill_to_next_step_seen_s``: it learns of steps by polling rank 0), the world-size history and whether
torch was imported in an actor. Under it (elastictrain/sim/phases.py): the actors' CPU while they trained
(all 128 processes, CPU-s per s); each phase of the recovery in seconds after the SIGKILL (the victim's
process gone, Ray's notice of its death, the driver's first wait and first ended calls, its state change,
the drain of the survivors' failed steps, the failure, the decision, ``open_store`` and ``join``
answered, the generation started, the end of its first step), the driver thread's CPU in each of the
controller's recovery methods, and the growth back (the replacement started, set up, the resize). The
replacement is a new Ray worker process started once the survivors train again: ``--steps`` defaults to
400 here so that it is in before the run ends (the policy grows back once it is ready, not within a time).

``--ray-death N``: Ray's own part, with N idle plain actors (no elastictrain): per SIGKILL, the process
gone and Ray's notice failing a call in flight; and what N idle actors cost (CPU, threads, niceness).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastictrain.sim.scenarios import SCENARIOS, run_scenario  # noqa: E402

SIM_STEPS = 100
# The Ray variant's replacement for the killed actor is a new Ray worker process (Python, Ray's import,
# its registration), started once the survivors train again, and the policy grows back once it is ready:
# a run must outlast that start (100 steps were too short on the development machine, 400 are enough:
# docs/perf/2026-11-24-ray-actors-recovery.md, "Growth back").
RAY_STEPS = 400


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int)
    ap.add_argument("--ray-actors", type=int, help="the Ray variant with this many actors (instead of --ranks)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--steps", type=int, help=f"steps per run (default {SIM_STEPS}; {RAY_STEPS} with --ray-actors)")
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--memory", action="store_true", help="tracemalloc peak (slows every run down)")
    ap.add_argument("--ray-death", type=int, metavar="N",
                    help="Ray's own part of a death's notice, with N idle plain actors (no elastictrain)")
    ap.add_argument("--ray-get", type=int, metavar="N",
                    help="what Ray charges the driver to wait for and take N ready run results (calibrates the "
                         "simulator's get)")
    args = ap.parse_args()
    if args.ray_get:
        return _ray_get_cost(args.ray_get)
    if args.ray_death:
        return _ray_death(args.ray_death)
    if args.ray_actors:
        args.steps = args.steps or RAY_STEPS
        return _ray_actors(args)
    args.steps = args.steps or SIM_STEPS
    if not args.ranks:
        ap.error("give --ranks N (the simulation) or --ray-actors N (the Ray variant)")
    rows = []
    for name in args.scenarios.split(","):
        t = time.perf_counter()
        r = run_scenario(name, args.ranks, steps=args.steps, step_s=args.step_s, memory=args.memory)
        row = {**dataclasses.asdict(r), "wall_s": round(time.perf_counter() - t, 2)}
        rows.append(row)
        print(f"{name:9s} N={args.ranks:6d} state={r.state:9s} steps={r.steps:3d} lost={r.lost_steps} "
              f"worlds={r.worlds} cpu/step={r.driver_cpu_per_step_s * 1e3:.3f}ms "
              f"busy={r.extra.get('driver_busy')} bytes/step={r.events_bytes_per_step:.0f} "
              f"detect={r.fault_to_detect_s} notice={r.extra.get('fault_to_notice_s')} "
              f"decide={r.fault_to_decision_s} growth={r.growth_s} mem={r.peak_mem_mb}MB "
              f"wall={row['wall_s']}s{_window(r.extra.get('decision_window'))}", flush=True)
    steady = next((r for r in rows if r["scenario"] == "steady"), rows[0])
    decisions = [r["fault_to_decision_s"] for r in rows
                 if r["scenario"] != "hang" and r["fault_to_decision_s"] is not None]
    if args.json:
        print(json.dumps({"ranks": args.ranks, "driver_cpu_per_step_s": steady["driver_cpu_per_step_s"],
                          "fault_to_decision_s": max(decisions, default=None),
                          "fault_to_notice_s": max((r["extra"]["fault_to_notice_s"] for r in rows
                                                    if "fault_to_notice_s" in r["extra"]), default=None),
                          "events_bytes_per_step": steady["events_bytes_per_step"],
                          "load_1min": os.getloadavg()[0], "scenarios": rows}))


def _window(w: dict | None) -> str:
    """The machine around the fault -> decision (elastictrain/sim/machine.py), for telling a slow run's
    cause: the decision's CPU, page faults, involuntary switches, the machine's busy time (both cores),
    this process's, steal, collections by generation."""
    if not w:
        return ""
    return (f"\n          window: cpu={w['cpu_s'] * 1e3:.1f}ms wall={w['wall_s'] * 1e3:.1f}ms "
            f"minor_faults={w['minor_faults']} involuntary_switches={w['involuntary_switches']} "
            f"machine_busy={w['machine_busy_s']}s process_busy={w['process_busy_s']}s steal={w['steal_s']}s "
            f"gc={w['gc_collections']}")


def _ray_get_cost(n: int, reps: int = 3) -> None:
    """The driver thread's CPU for one ``ray.wait`` over ``n`` ready results and for taking them with
    ``get_each`` (chunks of 1,024), as the controller takes a failed step's survivors' ``run`` results:
    real Ray, results as a survivor answers (packed: :mod:`elastictrain.worker_reply`) from 4 actors, and
    unpacked as the controller reads them. The simulator stands in for both calls (``SimWorld.get``, its
    run watch); this says what they would cost on Ray."""
    import ray

    from elastictrain import worker_reply
    from elastictrain.controller.runtime import RAY, get_each

    @ray.remote(num_cpus=0)
    class Answers:
        def run(self, slot: int) -> bytes:
            return worker_reply.pack("peer_failed", 50, None, slot)

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actors = [Answers.remote() for _ in range(4)]
        refs = [actors[i % 4].run.remote(i) for i in range(n)]
        ray.wait(refs, num_returns=n)
        for rep in range(reps):
            t = time.thread_time()
            ray.wait(refs, num_returns=n, timeout=0)
            waited = time.thread_time() - t
            t = time.thread_time()
            [worker_reply.unpack(packed) for packed, _ in get_each(RAY, refs)]
            taken = time.thread_time() - t
            print(f"ray: {n} ready results: wait {waited * 1e3:.1f} ms, get_each {taken * 1e3:.1f} ms "
                  f"({taken / n * 1e6:.1f} us per result) of driver CPU; load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        ray.shutdown()


def _ray_death(n: int, kills: int = 5) -> None:
    """Ray's own part of learning of a death, with plain actors (no elastictrain): ``n`` idle actors
    (``num_cpus=0``), then ``kills`` of them SIGKILLed one at a time while a call on each is in flight.
    Per kill: the SIGKILL to the process gone (its pidfd turns readable: the kernel's exit) and to Ray's
    notice (the call fails: the raylet sees the worker's socket close, the GCS publishes the death, the
    owner fails the call). Before the kills: what the idle actors cost (CPU over 10 s, threads each,
    their niceness: the raylet starts workers at ``RAY_worker_niceness``, 15 unless set)."""
    import select
    import signal
    import threading

    import ray

    from elastictrain.sim.ray_run import _cpu_s

    @ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0, max_concurrency=2)
    class Idle:
        def pid(self) -> int:
            return os.getpid()

        def block(self) -> None:
            threading.Event().wait()

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        actors = [Idle.remote() for _ in range(n)]
        pids = ray.get([a.pid.remote() for a in actors], timeout=600)
        threading.Event().wait(5)  # the start's own work settles
        cpu = _cpu_s(pids)
        threading.Event().wait(10)
        threads = sum(len(os.listdir(f"/proc/{p}/task")) for p in pids) / n
        print(f"ray-death: {n} idle actors take {(_cpu_s(pids) - cpu) / 10:.2f} CPU-s per s, {threads:.0f} threads "
              f"each, nice {os.getpriority(os.PRIO_PROCESS, pids[0])}; load {os.getloadavg()[0]:.1f}", flush=True)
        for actor, pid in list(zip(actors, pids))[:kills]:
            ref = actor.block.remote()
            ray.wait([ref], timeout=0.5)  # (in flight)
            fd = os.pidfd_open(pid)
            t = time.time()
            os.kill(pid, signal.SIGKILL)
            select.select([fd], [], [], 60)
            gone = time.time() - t
            os.close(fd)
            ray.wait([ref], timeout=60)
            notice = time.time() - t
            print(f"ray-death: SIGKILL -> process gone {gone * 1e3:.1f} ms, -> Ray's notice {notice * 1e3:.1f} ms; "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        ray.shutdown()


def _ray_actors(args: argparse.Namespace) -> None:
    import ray

    from elastictrain.sim.ray_run import run_ray_actors

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        t = time.perf_counter()
        r = run_ray_actors(args.ray_actors, steps=args.steps, step_s=args.step_s, kill_at=20)
        wall = round(time.perf_counter() - t, 2)
    finally:
        ray.shutdown()
    print(f"ray-actors N={r.actors} state={r.state} steps={r.steps} lost={r.lost_steps} worlds={r.worlds} "
          f"torch_in_actor={r.torch_in_actor} kill->detect={r.extra.get('kill_to_detect_s')}s "
          f"kill->generation={r.kill_to_generation_s}s "
          f"kill->next step={r.kill_to_next_step_s}s (seen by the driver "
          f"{r.extra.get('kill_to_next_step_seen_s')}s) wall={wall}s", flush=True)
    busy = r.extra.get("actors_cpu_per_s")
    print(f"  the actors' CPU while training (before the kill): {busy} CPU-s per s", flush=True)
    print("  phases (s after the kill): " + " ".join(f"{k}={v}" for k, v in r.extra["phases"].items()), flush=True)
    print("  driver CPU (ms) in: " + " ".join(f"{k}={v}" for k, v in r.extra["driver_cpu_ms"].items()), flush=True)
    print("  growth back (s after the kill): " + " ".join(f"{k}={v}" for k, v in r.extra["growth"].items()), flush=True)
    if args.json:
        print(json.dumps({**dataclasses.asdict(r), "wall_s": wall, "load_1min": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
