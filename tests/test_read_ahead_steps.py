"""``train.read_ahead_steps``: the step loop's batch read-ahead holds exactly the next K steps' micro-batches of
its rank (bounded: nothing past them, nothing past ``train.steps``), and the numbers trained do not depend
on K. One process (a one-rank gloo group), the worker's StepRunner on a hand-written prepared corpus, no Ray.

Broken on purpose (2026-11-28, failing here): the loop scheduling one step ahead whatever K (the read-ahead
before ``train.read_ahead_steps``): the pending batches after step 1 are step 2's only; the bound on
``train.steps`` left out: after the last steps the read-ahead still holds batches of steps the run never
trains."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint_fixtures import s3_bucket, s3_server  # noqa: F401 - fixtures
from tests.test_batch_prefetch import SEQ, corpus  # noqa: F401 - fixture

STEPS = 5


def _train(corpus_dir, k: int) -> tuple[list[float], list[set[tuple[int, ...]]], list[list[list[int]]]]:
    """``STEPS`` steps with ``read_ahead_steps=k``: every step's loss, the batches pending in the read-ahead
    after each step, and each step's micro-batches (the cursor's)."""
    import torch.distributed as dist

    from elastictrain import build_config
    from elastictrain.data.cursor import rank_micro_batches
    from tests.conftest import job
    from tests.ranks import attached_runner

    spec = job(task={**job()["task"], "data": {"source": str(corpus_dir)}},
               train={"steps": STEPS, "read_ahead_steps": k}, workers={"min": 1, "max": 1, "standby": False})
    spec["task"]["model"] = {**spec["task"]["model"], "seq_len": SEQ}
    cfg = build_config(spec)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runner = attached_runner(cfg, 0, 1)
        losses, pending = [], []
        for _ in range(STEPS):
            losses.append(runner.run_step(False)[0].loss)
            pending.append(set(runner.batches._pending))
        t = cfg.train
        micro = [[[int(i) for i in ids] for ids in rank_micro_batches(s, 0, 1, t.micro_batch, t.global_batch, t.seed,
                                                                      runner.dataset_len)] for s in range(STEPS)]
        runner.close_data()
    finally:
        dist.destroy_process_group()
    return losses, pending, micro


@pytest.mark.parametrize("k", [0, 3])
def test_the_read_ahead_holds_the_next_k_steps_and_trains_the_same_numbers(corpus, k):  # noqa: F811
    losses, pending, micro = _train(corpus, k)
    for s in range(STEPS):  # after step s (0-based): steps s+1 .. s+k, none past the run's last
        want = {tuple(ids) for t in range(s + 1, min(s + 1 + k, STEPS)) for ids in micro[t]}
        assert pending[s] == want, (k, s, sorted(pending[s]), sorted(want))
    ref, _, _ = _train(corpus, 1)
    assert losses == ref and all(torch.isfinite(torch.tensor(losses)))


def test_a_batch_read_ahead_from_s3_is_read_once(corpus, s3_server, s3_bucket):  # noqa: F811
    """The loop's calls with 2 steps of read-ahead (schedule steps s..s+2, take step s's micro-batches) for 6
    steps over the corpus on moto's S3: every batch is fetched exactly once (a batch stays asked for at
    three schedules; the read-ahead thread took it at the first), and equals the local synchronous read.
    Broken on purpose (2026-11-28, failing here): ``PreparedWindows.prefetch`` reading again a batch that
    ``batch`` already handed out (before ``_taken``): the batches of steps 2-6 fetched twice or more."""
    import threading
    from collections import Counter

    import s3fs

    from elastictrain.data.prefetch import BatchPrefetcher
    from elastictrain.data.windows import PreparedWindows
    from tests.test_batch_prefetch import _micro

    opts = s3_server.options()
    fs = s3fs.S3FileSystem(**opts)
    for p in sorted(corpus.rglob("*")):
        if p.is_file():
            fs.pipe_file(f"{s3_bucket}/c/{p.relative_to(corpus)}", p.read_bytes())
    reads: Counter = Counter()
    lock = threading.Lock()

    class Counted(PreparedWindows):
        def read_windows(self, ids):
            with lock:
                reads[tuple(int(i) for i in ids)] += 1
            return super().read_windows(ids)

    remote, local = Counted(f"{s3_bucket}/c", SEQ, storage_options=opts), PreparedWindows(str(corpus), SEQ)
    ahead = BatchPrefetcher(remote, None, batch=remote.batch)
    try:
        for s in range(6):
            ahead.schedule([ids for t in range(s, s + 3) for ids in _micro(t, 0, 1, len(local))])
            for ids in _micro(s, 0, 1, len(local)):
                got, want = ahead.take(ids), local.batch(ids)
                assert all(torch.equal(got[k], want[k]) for k in want), (s, ids)
            for future in list(ahead._pending.values()):  # the step's compute: the thread assembles what is ahead
                future.result()
    finally:
        ahead.close()
        remote.close()
    trained = [tuple(ids) for s in range(6) for ids in _micro(s, 0, 1, len(local))]
    assert all(reads[k] == 1 for k in trained), {k: reads[k] for k in trained if reads[k] != 1}
