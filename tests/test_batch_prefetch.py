"""The step loop's batch read-ahead (data/prefetch.py): a taken batch is exactly the batch a synchronous read
gives for the same ids, at every step and across a re-plan to another world size; a reset or a re-plan drops
the stale prefetch instead of assembling it. One process, a hand-written prepared corpus, no Ray."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from elastictrain.data.cursor import rank_micro_batches
from elastictrain.data.prefetch import BatchPrefetcher
from elastictrain.data.shards import Shard, manifest_json
from elastictrain.data.windows import PreparedWindows

SEQ, G, M, SEED = 16, 8, 2, 3


def _collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """Two shards of random uint16 tokens (windows cross the shard boundary)."""
    (tmp_path / "train").mkdir()
    shards = []
    for k, n in enumerate((1000, 777)):
        data = np.random.default_rng(k).integers(0, 500, n, dtype=np.uint16).astype("<u2").tobytes()
        (tmp_path / "train" / f"{k:05d}.bin").write_bytes(data)
        shards.append(Shard(f"train/{k:05d}.bin", n, len(data), "0" * 64))
    (tmp_path / "manifest.json").write_text(manifest_json(
        dtype="uint16", vocab_size=500, eos_id=0, tokenizer_sha256="0" * 64, text_column="text", sources=[],
        splits={"train": shards}, split_rule={"kind": "none"}, seq_len=None))
    return tmp_path


def _micro(step: int, rank: int, world: int, n: int) -> list[list[int]]:
    return [[int(i) for i in ids] for ids in rank_micro_batches(step, rank, world, M, G, SEED, n)]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_taken_batches_are_the_synchronous_ones_through_a_replan(corpus):
    """The loop's calls (schedule this and the next step, take each micro-batch) at world 2 rank 1 for 4 steps,
    then a re-plan to world 4 rank 3 at step 2 (a restore to an earlier step at another size): every batch
    taken equals a fresh synchronous read of the same ids, and the thread assembled it (the taker read none)."""
    w = PreparedWindows(str(corpus), SEQ)
    sync = PreparedWindows(str(corpus), SEQ)
    seen_threads: list[str] = []
    read = w.__getitem__

    def logged(i):
        seen_threads.append(threading.current_thread().name)
        return read(i)

    ahead = BatchPrefetcher(_Indexable(logged), _collate)
    try:
        for rank, world, steps in ((1, 2, range(0, 4)), (3, 4, range(2, 5))):
            ahead.reset()  # what attach() does at a regroup
            for s in steps:
                micro = _micro(s, rank, world, len(w))
                ahead.schedule(micro + _micro(s + 1, rank, world, len(w)))
                for ids in micro:
                    seen_threads.clear()
                    got = ahead.take(ids)
                    assert _same(got, _collate([sync[i] for i in ids])), (rank, world, s, ids)
                    assert threading.current_thread().name not in seen_threads, (s, seen_threads)
    finally:
        ahead.close()



def test_a_prepared_batch_read_equals_the_default_collate_of_its_windows(corpus):
    """``PreparedWindows.batch`` (what the loop's read-ahead uses with the default collate) is the default
    collate of the windows, bitwise, dtype and layout included, across the shard boundary; and the loop's
    prefetcher built with it hands out the same batches. Fails against a batch read one token short or off
    by one window."""
    from elastictrain.worker.loop import _default_collate

    w = PreparedWindows(str(corpus), SEQ)
    edge = 1000 // SEQ  # the window that crosses from shard 0 into shard 1
    for ids in ([0, 1, 2], [edge - 1, edge, edge + 1], [len(w) - 1, 5, edge]):
        got, want = w.batch(ids), _default_collate([w[i] for i in ids])
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype and got[k].is_contiguous(), (k, ids)
    ahead = BatchPrefetcher(w, _default_collate, batch=w.batch)
    try:
        micro = _micro(0, 0, 1, len(w))
        ahead.schedule(micro)
        assert all(_same(ahead.take(ids), _default_collate([w[i] for i in ids])) for ids in micro)
    finally:
        ahead.close()

class _Indexable:
    """``dataset[i]`` through a function (a dataset whose reads the test watches or gates)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __getitem__(self, i: int):
        return self.fn(i)


@pytest.mark.parametrize("how", ["reset", "replan"])
def test_reset_and_a_replan_drop_the_stale_prefetch(corpus, how):
    """The thread held inside the first scheduled batch's first read; the rest are stale by the time it goes
    on: a reset (attach at a regroup) or a schedule of other batches (the first step after a re-plan) cancels
    them at once, so they are never read, and what is taken next is the new ids' batch."""
    w = PreparedWindows(str(corpus), SEQ)
    started, release = threading.Event(), threading.Event()
    reads: list[int] = []

    def gated(i: int):
        reads.append(i)
        if not started.is_set():
            started.set()
            release.wait()
        return w[i]

    ahead = BatchPrefetcher(_Indexable(gated), _collate)
    try:
        stale = _micro(0, 0, 2, len(w)) + _micro(1, 0, 2, len(w))
        fresh = _micro(5, 1, 4, len(w))
        ahead.schedule(stale)
        assert started.wait(timeout=60)
        if how == "reset":
            ahead.reset()
            assert not ahead._pending  # nothing held for the old group
        else:
            ahead.schedule(fresh)
            assert set(ahead._pending) == {tuple(ids) for ids in fresh}
        release.set()
        for ids in fresh:
            assert _same(ahead.take(ids), _collate([w[i] for i in ids]))
        ahead.close()
        dropped = {i for ids in stale[1:] for i in ids} - {i for ids in fresh for i in ids}
        assert dropped and not dropped & set(reads), sorted(dropped & set(reads))
    finally:
        release.set()
        ahead.close()


def test_a_read_error_reaches_the_taker(corpus):
    """A failed read in the thread raises in the step that takes the batch, as a synchronous read would."""
    w = PreparedWindows(str(corpus), SEQ)

    def failing(i: int):
        raise OSError(f"read of window {i} failed")

    ahead = BatchPrefetcher(_Indexable(failing), _collate)
    try:
        ids = _micro(0, 0, 1, len(w))[0]
        ahead.schedule([ids])
        with pytest.raises(OSError, match="read of window"):
            ahead.take(ids)
    finally:
        ahead.close()


class _WatchedWindows(PreparedWindows):
    """A prepared split that notes which thread reads each window."""

    readers: list[str]

    def __getitem__(self, index: int):
        self.readers.append(threading.current_thread().name)
        return super().__getitem__(index)

    def batch(self, ids):  # the loop's read-ahead reads whole micro-batches (default collate)
        self.readers.extend([threading.current_thread().name] * len(ids))
        return super().batch(ids)


class _Synchronous:
    """The same windows without ``prefetch``: the loop reads them in the step, as before the read-ahead."""

    def __init__(self, windows: PreparedWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int):
        return self.windows[index]


def test_the_loop_trains_the_same_numbers_on_batches_read_ahead(corpus):
    """The worker's StepRunner (one rank, in this process) for 6 steps on the prepared corpus: with the
    read-ahead every step's loss and the final parameters are exactly those of reading in the step, and the
    step itself read no window (the one read in the step loop's thread is its set-up's sample-length probe)."""
    import dataclasses

    from elastictrain import build_config
    from elastictrain.task import builtin_task
    from tests.conftest import job
    from tests.parallel_fixtures import InProcessRun

    spec = job(task={**job()["task"], "data": {"source": str(corpus)}},
               train={"steps": 6, "audit_samples": True}, workers={"min": 1, "max": 1, "standby": False})
    spec["task"]["model"] = {**spec["task"]["model"], "seq_len": SEQ}
    base = builtin_task(build_config(spec))
    watched = _WatchedWindows(str(corpus), SEQ)
    watched.readers = []
    ahead = InProcessRun(spec, task=dataclasses.replace(base, dataset_fn=lambda: watched))
    inline = InProcessRun(spec, task=dataclasses.replace(
        base, dataset_fn=lambda: _Synchronous(PreparedWindows(str(corpus), SEQ))))
    assert ahead.losses() == inline.losses() and len(ahead.losses()) == 6
    pa, pi = ahead.final_params(), inline.final_params()
    assert pa.keys() == pi.keys() and all(torch.equal(pa[k], pi[k]) for k in pa)
    main = threading.main_thread().name
    assert watched.readers.count(main) == 1, watched.readers.count(main)
    assert len(watched.readers) > 6 * 8, len(watched.readers)
