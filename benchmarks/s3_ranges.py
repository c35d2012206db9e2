"""S3 range-read counts (a script, not a test): GETs and bytes of the two coalesced readers, from their plans.

    PYTHONPATH=. python benchmarks/s3_ranges.py [--out s3_ranges.json]

Counts, not times: what each reader asks an object store for is a pure function of the shapes, the layout and
the merge gap (elastictrain/byte_ranges.py ``plan_reads``), so they are computed here without a server (the
same plans tests/test_s3_ranges.py checks byte for byte against a counting moto server).

- init_from: the Llama 3.1 8B, 70B and 405B shapes (bf16 safetensors), one tensor-parallel rank's slices
  (wq/wk/wv/w1/w3/output/embedding on dim 0, wo/w2 on dim 1 as models/llama.py's plan shards them; norms
  whole), per rank: the whole-row reader of before (one GET per tensor, its rows whole), per-row ranges with
  no merging (gap 0), a 64 KiB merge and the 1 MiB merge of the per-slice reader, and the row blocks of
  models/hf_rows.py (the default since; wo/w2 read as 1/tp of their rows whole, ``exchanged``: the bytes the
  rank sends its tp peers in the all-to-all). Each tensor is planned alone (no merge across tensors: a file's
  layout is the writer's), so the merged counts are an upper bound on GETs.
- windows: a rank's micro-batches through the sample cursor (``rank_micro_batches``), one GET per window
  piece before vs one coalesced read per batch after, for a small corpus (where a batch's windows often lie
  within 64 KiB) and a large one; and held-out evaluation batches (adjacent windows, ``eval_sample_ids``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from elastictrain.byte_ranges import MERGE_GAP, WEIGHTS_MERGE_GAP, plan_reads, slice_runs  # noqa: E402
from elastictrain.data.cursor import eval_sample_ids, rank_micro_batches  # noqa: E402
from elastictrain.models.llama import LLAMA_PRESETS  # noqa: E402

BF16 = 2


def _layer_tensors(p: dict) -> list[tuple[str, tuple[int, int], int]]:
    """(name, shape, sharded dim) of one decoder layer's matrices under tp."""
    dim, hd = p["dim"], p["dim"] // p["n_heads"]
    kv = p["n_kv_heads"] * hd
    return [("wq", (dim, dim), 0), ("wk", (kv, dim), 0), ("wv", (kv, dim), 0), ("wo", (dim, dim), 1),
            ("w1", (p["ffn_hidden"], dim), 0), ("w3", (p["ffn_hidden"], dim), 0), ("w2", (dim, p["ffn_hidden"]), 1)]


def _counts(shape: tuple[int, int], sharded: int, tp: int, gap: int | str | None) -> tuple[int, int, int, int]:
    """(GETs, bytes fetched, bytes held, bytes sent to peers) of rank 0's slice of one tensor; ``gap`` None:
    the whole-row reader; "rows": row blocks (models/hf_rows.py) where they apply, else a 1 MiB merge."""
    lengths = list(shape)
    lengths[sharded] //= tp
    held = lengths[0] * lengths[1] * BF16
    if gap is None:
        return 1, lengths[0] * shape[1] * BF16, held, 0
    if gap == "rows":
        from torch.distributed.tensor import Shard

        from elastictrain.models.hf_rows import plan_row_block

        block, _, _ = plan_row_block(shape, BF16, [0, 0], lengths, [Shard(sharded)], [tp], [0])
        if block is not None:
            a, b = block.read_range()
            return 1, b - a, held, sum(block.send_bytes(j) for j in range(tp) if j != block.me)
        gap = WEIGHTS_MERGE_GAP
    reads, _ = plan_reads([("f", a, b) for a, b in slice_runs(shape, [0, 0], lengths, BF16)], gap)
    return len(reads), sum(r.end - r.start for r in reads), held, 0


def init_from(sizes: list[str], tps: list[int]) -> list[dict]:
    rows = []
    for size in sizes:
        p = LLAMA_PRESETS[size]
        whole = [("embed", (p["vocab_size"], p["dim"]), 0), ("output", (p["vocab_size"], p["dim"]), 0)]
        for tp in tps:
            row = {"size": size, "tp": tp}
            for label, gap in (("whole_rows", None), ("gap_0", 0), ("gap_64k", MERGE_GAP),
                               ("gap_1m", WEIGHTS_MERGE_GAP), ("row_blocks", "rows")):
                gets = fetched = held = sent = 0
                tensors = [(shape, d, p["n_layers"]) for _, shape, d in _layer_tensors(p)]
                for shape, d, copies in tensors + [(shape, d, 1) for _, shape, d in whole]:
                    g, f, h, x = _counts(shape, d, tp, gap)
                    gets, fetched, held = gets + g * copies, fetched + f * copies, held + h * copies
                    sent += x * copies
                norms = (2 * p["n_layers"] + 1) * p["dim"] * BF16  # whole on every rank: one GET each
                row[label] = {"gets": gets + 2 * p["n_layers"] + 1, "bytes": fetched + norms}
                if gap == "rows":
                    row[label]["exchanged"] = sent
                row["held_bytes"] = held + norms
            rows.append(row)
    return rows


def windows(tokens: int, itemsize: int, seq: int, world: int, micro: int, global_batch: int, steps: int) -> dict:
    """Rank 0's GETs and bytes over ``steps`` training steps and ``steps`` evaluation batches of a one-shard
    split of ``tokens`` tokens."""
    n = (tokens - 1) // seq
    out = {"tokens": tokens, "itemsize": itemsize, "seq_len": seq, "world": world, "micro_batch": micro,
           "global_batch": global_batch, "steps": steps}
    for kind in ("train", "eval"):
        if kind == "train":
            batches = [b for s in range(steps) for b in rank_micro_batches(s, 0, world, micro, global_batch, 0, n)]
        else:
            batches = [eval_sample_ids(j, 0, world, micro, global_batch, k, n) for j in range(steps)
                       for k in range(global_batch // (world * micro))]
        before = after = before_b = after_b = 0
        for ids in batches:
            pieces = [("s", int(i) * seq * itemsize, (int(i) * seq + seq + 1) * itemsize) for i in ids]
            reads, _ = plan_reads(pieces, MERGE_GAP)
            before, before_b = before + len(pieces), before_b + sum(e - s for _, s, e in pieces)
            after, after_b = after + len(reads), after_b + sum(r.end - r.start for r in reads)
        out[kind] = {"batches": len(batches), "gets_before": before, "gets_after": after, "bytes_before": before_b,
                     "bytes_after": after_b}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {
        "init_from": init_from(["8b", "70b", "405b"], [2, 8]),
        "windows": [windows(2_000_000, 2, 1024, 8, 8, 256, 100),  # a small corpus (4 MB of uint16)
                    windows(10_000_000_000, 4, 8192, 8, 2, 256, 100)],  # 40 GB of uint32 (Llama 3's vocabulary)
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
