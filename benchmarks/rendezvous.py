"""Store operations of one generation's rendezvous, counted: ``init_process_group("gloo")`` over a TCPStore
(as elastictrain's ``join`` does), at N real processes, with every store call counted through a wrapper.

Usage::

    python benchmarks/rendezvous.py --ranks 2 4 8

Prints, per N, the store operations by kind (summed over ranks) and per rank; docs/design.md ("The control
plane at scale") fits the model to them.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp


class CountingStore(dist.Store):
    """Every call to ``inner`` counted by name (the process group's own calls come through here)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.calls = inner, collections.Counter()

    def _count(self, name: str, n: int = 1) -> None:
        self.calls[name] += n

    def set(self, key, value):  # noqa: ANN001 - torch's Store signature
        self._count("set")
        return self.inner.set(key, value)

    def get(self, key):  # noqa: ANN001
        self._count("get")
        return self.inner.get(key)

    def add(self, key, value):  # noqa: ANN001
        self._count("add")
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):  # noqa: ANN001
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):  # noqa: ANN001
        self._count("check")
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):  # noqa: ANN001
        self._count("wait")
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key):  # noqa: ANN001
        self._count("delete_key")
        return self.inner.delete_key(key)

    def num_keys(self):
        self._count("num_keys")
        return self.inner.num_keys()

    def set_timeout(self, timeout):  # noqa: ANN001
        return self.inner.set_timeout(timeout)


def _rank(rank: int, world: int, port: int, out: mp.Queue) -> None:
    timeout = datetime.timedelta(seconds=120)
    tcp = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout, wait_for_workers=False)
    store = CountingStore(tcp)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    dist.barrier()
    out.put((rank, dict(store.calls)))
    dist.destroy_process_group()


def measure(world: int) -> dict[str, int]:
    master = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, master.port, out)) for r in range(world)]
    for p in procs:
        p.start()
    counts = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    total: collections.Counter[str] = collections.Counter()
    for _, c in counts:
        total.update(c)
    return dict(total)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    for n in args.ranks:
        total = measure(n)
        ops = sum(total.values())
        print(json.dumps({"ranks": n, "store_ops": ops, "per_rank": round(ops / n, 1), "by_kind": total}),
              flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
