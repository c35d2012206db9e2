"""Own error or a peer's death (elastictrain/worker/errors.py): the classifier's verdict on real errors,
the communication one raised by gloo in a rank whose peer died, not on hand-written messages alone."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from elastictrain.worker.errors import classify_step_error, framework_collective, is_communication_error
from tests.checkpoint_fixtures import free_port
from tests.ranks import context


def _rank(rank: int, port: int, verdicts) -> None:  # noqa: ANN001 - a multiprocessing queue
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        dist.barrier()
        os._exit(0)  # dies without a word, as a SIGKILLed peer does
    try:
        dist.barrier()  # may already see rank 1 gone: a communication error as well
        dist.all_reduce(torch.ones(4))
        verdicts.put("no error")
    except Exception as e:  # noqa: BLE001 - what gloo raises is the point
        try:
            raise ValueError("the step failed") from e  # wrapped on its way up: the cause still counts
        except ValueError as wrapped:
            verdicts.put((f"{type(e).__name__}: {e}"[:200], classify_step_error(e), classify_step_error(wrapped)))
    verdicts.close()
    verdicts.join_thread()  # the put is flushed by a feeder thread that os._exit would cut short
    os._exit(0)  # skip destroying a group whose peer is gone


def test_a_dead_peer_under_a_real_gloo_collective_is_peer_failed() -> None:
    ctx = context()
    verdicts = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, verdicts)) for r in (0, 1)]
    for p in procs:
        p.start()
    what = verdicts.get(timeout=600)  # a bound on a broken test, not a timing claim
    for p in procs:
        p.join(timeout=60)
    assert what != "no error"
    text, direct, wrapped = what
    assert (direct, wrapped) == ("peer_failed", "peer_failed"), text


def _own_autograd_error() -> RuntimeError:
    try:
        torch.nn.Linear(3, 2)(torch.ones(2, 4))
    except RuntimeError as e:
        return e
    raise AssertionError("no error")


def test_own_errors_are_error_whatever_their_words() -> None:
    assert classify_step_error(_own_autograd_error()) == "error"  # a RuntimeError from torch itself
    assert classify_step_error(ValueError("loss is nan")) == "error"
    assert classify_step_error(KeyError("input_ids")) == "error"
    # Words of the backend in an error that is not a RuntimeError: still this rank's own error.
    assert classify_step_error(ValueError("timed out reading my own file over a socket")) == "error"
    own = ValueError("bad batch")
    try:
        raise RuntimeError("step 5 failed") from own
    except RuntimeError as e:
        assert classify_step_error(e) == "error"


def _from_cpp_at_a_framework_collective(text: str) -> RuntimeError:
    """A ``RuntimeError`` as gloo raises it out of C++ at a collective the framework called (DDP's all-reduce
    in the last backward): marked by :func:`framework_collective`, no Python frame below the call."""
    e = RuntimeError(text)
    try:
        with framework_collective():
            raise e
    except RuntimeError:
        pass
    e.__traceback__ = None
    return e


GLOO = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"


def test_communication_errors_are_peer_failed_by_type_and_origin() -> None:
    for typed in (dist.DistError("store"), dist.DistBackendError("NCCL communicator was aborted on rank 1"),
                  dist.DistNetworkError("recv"), dist.DistStoreError("timeout")):
        assert classify_step_error(typed) == "peer_failed", typed
    assert classify_step_error(_from_cpp_at_a_framework_collective(GLOO)) == "peer_failed"
    ddp = f"Got the following error when running the callback: RuntimeError: {GLOO}"  # DDP's reducer wraps it
    assert classify_step_error(_from_cpp_at_a_framework_collective(ddp)) == "peer_failed"
    try:
        raise ValueError("the step failed") from _from_cpp_at_a_framework_collective(GLOO)
    except ValueError as wrapped:
        assert is_communication_error(wrapped)


def _users_loss() -> None:
    raise RuntimeError("socket timeout reading my features")


def _users_backend_words() -> None:
    raise RuntimeError(GLOO)


def test_words_do_not_make_a_peer_failure() -> None:
    """The user's own errors, whatever they say: raised by the user's code, even inside a framework
    collective (a custom autograd function in the last backward), or a backend-looking message raised
    anywhere but at a collective."""
    assert classify_step_error(RuntimeError("socket timeout")) == "error"
    for raise_it in (_users_loss, _users_backend_words):
        try:
            with framework_collective():
                raise_it()
        except RuntimeError as e:
            assert classify_step_error(e) == "error", e
    assert classify_step_error(ConnectionResetError("reset by my feature server")) == "error"
    assert classify_step_error(TimeoutError("my data loader")) == "error"
    unmarked = RuntimeError(GLOO)  # a backend's words, never at a collective
    assert classify_step_error(unmarked) == "error"


def test_users_loss_raising_socket_timeout_fails_fast_as_its_own_error(tmp_path, ray_local) -> None:
    """Rank 1's ``loss_fn`` raises ``RuntimeError("socket timeout ...")`` on every call: that is the user's
    error (it used to read as a peer's death by its words): counted against rank 1, quoted, and the run
    stops as a crash loop instead of regrouping around a peer that never died. (A real peer's death still
    recovers: test_a_dead_peer_under_a_real_gloo_collective_is_peer_failed above, and the survivor of
    tests/test_failures.py's raised_run, whose own error is rank 1's.)"""
    import dataclasses
    import threading

    from elastictrain import build_config
    from elastictrain.task import builtin_task
    from elastictrain.trainer import Trainer
    from tests.conftest import Run, job
    from tests.user_errors import loss_that_says_socket_timeout

    spec = job(train={"steps": 6}, recovery={"mode": "strict", "max_failures_per_rank": 1})
    task = dataclasses.replace(builtin_task(build_config(spec)), loss_fn=loss_that_says_socket_timeout)
    trainer = Trainer(build_config(spec), task, run_dir=tmp_path / "run", console=None)
    done: dict = {}
    thread = threading.Thread(target=lambda: done.setdefault("result", trainer.fit()), daemon=True)
    thread.start()
    thread.join(240)  # a bound on a broken build that regroups forever, not a timing claim
    assert "result" in done, "the run did not stop: it kept recovering from the user's own error"
    run = Run(done["result"])
    assert run.result.exit_code == 1, run.summary
    (failed,) = run.of("run_failed")
    assert "socket timeout reading my features" in failed["reason"] and "crash loop" in failed["reason"], failed
    assert {(e["kind"], e["rank"]) for e in run.of("failure")} == {("exception", 1)}, run.of("failure")
    assert not run.of("step")  # no step ever completed: nothing was trained around the user's bug
