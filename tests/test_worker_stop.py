"""A stop request that arrives late -- after the generation it was meant for left its loop -- must not stop
the next generation (it did after one step, and the controller counted a spurious group failure). A real
Worker in this process, a real world-1 gloo group per generation (issue #21 item 9)."""

from __future__ import annotations

from elastictrain import build_config, worker_reply
from elastictrain.task import builtin_task
from elastictrain.worker.actor import Worker
from tests.conftest import job


def _run(w: Worker, target_step: int) -> dict:
    return worker_reply.unpack(w.run(target_step))  # the bytes the controller takes (elastictrain/worker_reply.py)


def _join(w: Worker, generation: int) -> None:
    host, port = w.open_store(generation)
    w.join(generation, 0, 1, host, port)


def test_a_late_stop_request_does_not_stop_the_next_generation(ray_local) -> None:
    config = build_config(job(workers={"min": 1, "max": 1}, train={"steps": 4}))
    w = Worker(config, builtin_task(config), slot=0)
    try:
        w.setup()
        _join(w, 0)
        assert _run(w, 2) == {"status": "done", "step": 2, "error": None, "slot": 0}
        w.request_stop()    # meant for generation 0, arrives after its run returned
        _join(w, 1)
        got = _run(w, 4)
        assert (got["status"], got["step"]) == ("done", 4), got
        w.request_stop(0)   # names generation 0, arrives once generation 1 is joined
        assert _run(w, 5)["status"] == "done"
        w.request_stop(1)   # a stop of the current generation still stops it at the next step boundary
        got = _run(w, 8)
        assert (got["status"], got["step"]) == ("stopped", 6), got
    finally:
        w.shutdown()
