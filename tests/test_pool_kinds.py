"""``workers.reuse`` across the built-in task kinds (elastictrain/controller/warm_pool.py ``task_identity``):
the tiny GPT's and the Llama's callables are defined in the same files, so a process that trained one serves
a run of the other, and that run trains what a fresh process trains. (The pool's key held ``task.kind``
besides the files: the suite's modules alternating GPT and Llama runs in one driver started fresh processes
at each switch, ~4 CPU-s each, though the docs' rule is the task's files. Against that build the Llama run
below starts a process of its own and the test fails.)"""

from __future__ import annotations

from elastictrain.controller.warm_pool import POOL
from tests.conftest import job, run_job
from tests.parallel_fixtures import InProcessRun, assert_same_numbers

ONE = {"min": 1, "max": 1}
LLAMA = job(name="llama", task={"kind": "llama", "llama": {"size": "debug"}, "model": {"seq_len": 16, "dropout": 0.0}},
            train={"steps": 3, "global_batch": 4, "micro_batch": 2}, workers=ONE)


def test_a_process_that_trained_the_gpt_serves_a_llama_run_with_a_fresh_ones_numbers(tmp_path, ray_local):
    gpt = run_job(tmp_path, job(name="gpt", train={"steps": 2}, workers=ONE), name="gpt")
    (g,) = gpt.of("worker_started")
    assert gpt.result.exit_code == 0 and g["pid"] in POOL.pids(), (gpt.summary, POOL.pids())  # given back
    llama = run_job(tmp_path, LLAMA, name="llama")
    (w,) = llama.of("worker_started")
    assert w["reused"] and w["pid"] == g["pid"], (w, g)  # the GPT's process, the most recently given back
    assert llama.result.exit_code == 0 and llama.summary["final_step"] == 3, llama.summary
    # every step's loss and the final parameters: those of the Llama job trained afresh (in this process)
    assert_same_numbers(llama, InProcessRun(LLAMA))
