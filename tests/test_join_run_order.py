"""A generation's ``run`` sent right behind its ``join`` (``GenerationFormer._run_after``: one round of calls
instead of two), on the real Worker actor: the run takes its join's call as argument, so Ray starts it only
once that join returned, and a failed join fails it at once with the join's error, the step loop never
entered. Both calls share the worker's one state thread: a run that waited inside the actor for its join
would hold the thread the join needs (Ray does not order a threaded actor's calls).

A real Worker actor (rank 0) and a real Worker in this process (rank 1), a real 2-rank gloo group."""

from __future__ import annotations

import threading

import pytest
import ray

from elastictrain import build_config, worker_reply
from elastictrain.task import builtin_task
from elastictrain.worker.actor import Worker, worker_actor_class
from tests.conftest import job


@pytest.fixture
def config():
    return build_config(job(workers={"min": 2, "max": 2}, train={"steps": 4}, checkpoint={"memory_every_steps": 0}))


def test_a_run_sent_behind_a_join_still_waiting_for_its_peer_starts_after_it_and_trains(ray_local, config) -> None:
    actor = worker_actor_class().options(num_cpus=0).remote(config, builtin_task(config), 0)
    peer = Worker(config, builtin_task(config), slot=1)
    try:
        ray.get(actor.setup.remote())
        peer.setup()
        host, port = ray.get(actor.open_store.remote(1))
        joined = actor.join.remote(1, 0, 2, host, port, sync_src=0)
        ran = actor.run.remote(3, joined)
        # rank 1 has not joined: the join cannot have returned, so neither can the run (not a timing: the
        # rendezvous needs both ranks), and the run does not hold the state thread the join runs on
        assert ray.wait([joined, ran], num_returns=1, timeout=1.0)[0] == []
        assert peer.join(1, 1, 2, host, port, sync_src=0) == 0
        got: dict = {}
        trains = threading.Thread(target=lambda: got.update(worker_reply.unpack(peer.run(3))))
        trains.start()
        assert ray.get(joined) == 0
        mine = worker_reply.unpack(ray.get(ran))
        trains.join()
        assert (mine["status"], mine["step"]) == ("done", 3), mine
        assert (got["status"], got["step"]) == ("done", 3), got
    finally:
        peer.shutdown()
        ray.kill(actor)


def test_a_run_whose_join_failed_fails_with_its_error_and_never_starts(ray_local, config) -> None:
    actor = worker_actor_class().options(num_cpus=0).remote(config, builtin_task(config), 0)
    try:
        ray.get(actor.setup.remote())
        host, port = ray.get(actor.open_store.remote(1))
        joined = actor.join.remote(1, 0, 1, host, port, restore=[], sync_src=0)  # refused: one or the other
        ran = actor.run.remote(3, joined)
        with pytest.raises(ray.exceptions.RayTaskError, match="restore and sync_src exclude each other"):
            ray.get(ran, timeout=60)  # (a bound on a hang, not a timing: it fails at once)
        view = ray.get(actor.poll.remote())
        assert (view["status"], view["step"], view["records"]) == ("ready", 0, []), view  # the loop never ran
        # the worker is fine: the next generation joins and trains
        joined = actor.join.remote(2, 0, 1, host, port, sync_src=0)
        assert worker_reply.unpack(ray.get(actor.run.remote(2, joined)))["step"] == 2
    finally:
        ray.kill(actor)
