"""A survivor that leaves a step broken by a peer's death frees the live peers blocked on it at once, even
while one of its own collectives is still running (issue #21, "a DDP survivor under gloo waits out
``timeouts.collective_s``").

gloo's group destructor waits for the collectives queued or running on its threads. In the 50.7M-GPT kill
runs, a DDP bucket's all-reduce on one survivor was still waiting for a live peer that had left that
bucket's all-reduce when the step failed, and that peer waited for the first survivor's connections to
close: both waited out ``collective_s`` (60 s; "Timed out waiting 60000ms for recv" in a survivor's log).
Here the same knot is tied on purpose, with real Workers (``join`` builds the generation's real gloo
groups) in three real processes and a real SIGKILL: rank 0 has an all-reduce in flight that rank 1 never
joins, rank 1 waits in a broadcast from rank 0, rank 2 is killed. Rank 0's receive from rank 2 fails, and
its ``_release_groups`` must free rank 1. ``collective_s`` is far beyond the test's bound on a hang, so
rank 1 wakes within it only if rank 0 let it go: no clock is compared, however loaded the machine. Before
the fix (destroying the groups only) rank 1 woke after ``collective_s``. Every rank's blocking operation is
posted (queued on its group) before it says it is ready, so the kill finds each inside it: no sleep orders
them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import torch.distributed as dist

from tests.checkpoint_fixtures import free_port
from tests.conftest import job
from tests.ranks import context

COLLECTIVE_S = 1800  # never reached: waking at all within HANG_S means released, not timed out
HANG_S = 240  # bounds a hang (the broken build's rank 1 waits out COLLECTIVE_S); not a figure
TIMEOUTS = {"collective_s": COLLECTIVE_S, "step_watchdog_cap_s": COLLECTIVE_S + 10,
            "poll_s": COLLECTIVE_S + 20, "restart_grace_s": COLLECTIVE_S + 30, "watchdog_floor_s": 2}


def _worker(rank: int):
    from elastictrain import build_config
    from elastictrain.task import builtin_task
    from elastictrain.worker.actor import Worker
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    config = build_config(job(workers={"min": 3, "max": 3}, train={"global_batch": 12, "micro_batch": 4},
                                 timeouts=TIMEOUTS))
    w = Worker(config, builtin_task(config), slot=rank)
    # what ``setup`` builds, without its Ray-only report
    w.runner = StepRunner(w.task, config.train, FaultInjector([]), parallel=config.parallel)
    return w


def _rank(rank: int, port: int, out: str) -> None:
    import torch

    w = _worker(rank)
    w.join(0, rank, 3, "127.0.0.1", port)
    report: dict = {"connections": len(w._connections)}
    ready = Path(out) / f"ready{rank}"
    if rank == 2:
        ready.write_text("")
        threading.Event().wait()  # killed by the test
        return
    if rank == 0:
        # a collective rank 1 never joins: it waits on rank 1 from one of the group's threads, as a DDP
        # bucket's all-reduce waits on a peer that left it (rank 1 is blocked on rank 0 below)
        pending = dist.all_reduce(torch.ones(1 << 16), async_op=True)
        receiving = dist.irecv(torch.zeros(4), src=2)  # rank 2 never sends: fails when it dies
        ready.write_text("")
        try:
            receiving.wait()
        except RuntimeError as e:
            report["failed"] = str(e)[:120]
        t0 = time.time()
        del pending  # the step's own handles are gone by the time a worker releases (DDP's futures)
        w._release_groups()
        report["release_s"] = time.time() - t0
        report["failed_at"] = t0
    else:
        waiting = dist.broadcast(torch.zeros(4), src=0, async_op=True)  # rank 0 never sends: freed only by
        ready.write_text("")                                             # rank 0 letting go
        try:
            waiting.wait()
        except RuntimeError as e:
            report["woke_at"] = time.time()
            report["error"] = str(e)[:120]
        w._release_groups()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))


def test_a_survivor_with_a_collective_in_flight_frees_its_blocked_peer_at_once(tmp_path) -> None:
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the generation's store
    procs = [context().Process(target=_rank, args=(r, port, str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    try:
        deadline = time.time() + HANG_S  # set-up on a loaded machine; not a figure
        while not all((tmp_path / f"ready{r}").exists() for r in range(3)):
            assert time.time() < deadline and all(p.is_alive() for p in procs), "the ranks did not join"
            time.sleep(0.05)
        os.kill(procs[2].pid, signal.SIGKILL)  # each rank's blocking operation is already posted
        deadline = time.time() + HANG_S
        for p in procs[:2]:
            p.join(max(0.0, deadline - time.time()))
        hung = [r for r, p in enumerate(procs[:2]) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        del store
    assert not hung, f"rank(s) {hung} still blocked {HANG_S} s after the kill (collective_s {COLLECTIVE_S})"
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    # the generation's gloo connections were found at join: every pair of 3 ranks, in each of its groups
    assert r0["connections"] >= 2 and r1["connections"] >= 2, (r0, r1)
    assert "failed" in r0, r0  # rank 0's step broke on the dead rank
    assert "woke_at" in r1, r1
    # woke at all: within HANG_S, far below collective_s, so rank 0's release freed it (not a timeout)
    print(f"rank 1 woke {r1['woke_at'] - r0['failed_at']:.2f} s after rank 0 failed; rank 0's release took "
          f"{r0['release_s']:.2f} s (collective_s {COLLECTIVE_S})")


def test_sever_shuts_only_the_connections_opened_since_and_never_a_listener() -> None:
    """``Connections.opened_since``: a server that listened before (Ray's, the rendezvous store's) keeps
    its clients' connections, a listener opened since (gloo's) keeps listening; the connections opened
    since (gloo's pairs, both the accepted and the connecting side) are shut down."""
    import socket

    from elastictrain.worker.gloo_sever import Connections, Snapshot

    old = socket.create_server(("127.0.0.1", 0))  # e.g. Ray's gRPC server: listening before the join
    client_of_old = socket.create_connection(old.getsockname())  # (another process's, as far as the join knows)
    before = Snapshot.take()
    accepted_by_old, _ = old.accept()  # another server's client, accepted during the join: must stay up
    new = socket.create_server(("127.0.0.1", 0))  # gloo's listener
    ours = socket.create_connection(new.getsockname())  # a pair this rank connected
    theirs, _ = new.accept()  # a pair a peer connected
    found = Connections.opened_since(before)
    fds = {fd for fd, _ in found.conns}
    assert ours.fileno() in fds and theirs.fileno() in fds
    assert new.fileno() not in fds and accepted_by_old.fileno() not in fds
    assert found.sever() == len(found)
    assert theirs.recv(1) == b"" and ours.recv(1) == b""  # both ends see the connection end
    accepted_by_old.sendall(b"x")
    assert client_of_old.recv(1) == b"x"  # the other server's connection is untouched...
    late = socket.create_connection(new.getsockname())
    assert new.accept()[0] is not None  # ...and so is the listener
    for s in (old, client_of_old, accepted_by_old, new, ours, theirs, late):
        s.close()
