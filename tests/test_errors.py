"""Own error or a peer's death (elastictrain/worker/errors.py): the classifier's verdict on real errors,
the communication one raised by gloo in a rank whose peer died, not on hand-written messages alone."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from elastictrain.worker.errors import classify_step_error, is_communication_error
from tests.ranks import context


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = _free_port()
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


def test_communication_errors_are_peer_failed() -> None:
    assert classify_step_error(ConnectionResetError("reset")) == "peer_failed"
    assert classify_step_error(TimeoutError()) == "peer_failed"
    assert classify_step_error(dist.DistError("store")) == "peer_failed"
    assert classify_step_error(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                                            "[127.0.0.1]:1234")) == "peer_failed"
    assert is_communication_error(RuntimeError("NCCL communicator was aborted on rank 1"))
