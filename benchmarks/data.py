"""Data benchmark (a script, not a test): prepare throughput, read throughput, RSS vs corpus size, data wait.

    PYTHONPATH=. python benchmarks/data.py [--copies 160] [--files 8] [--no-s3] [--out data.json]

Corpus: Python's docs (the built-in corpus's text) repeated ``--copies`` times over ``--files`` JSON-lines files
(the default: ~20 M tokens, large enough that Ray's fixed costs do not decide the comparison; a real corpus is
GB-TB); tokenizer: a 2,048-id byte-level BPE trained on it here (nothing downloaded).

- prepare: tokens/s of ``elastictrain data prepare`` on a private local Ray with one CPU per available core
  (one task per file, one CPU each; Ray's workers started beforehand by a small warm-up prepare) vs the same
  units in this one process (``local_process=True``); the outputs are checked byte-identical. Both sides
  tokenize with one thread (``RAYON_NUM_THREADS=1``): the pair compares processes, not thread pools.
- read: tokens/s one worker reads as random windows (seq_len 1024) from the local shards (pread) and from a
  moto S3 server (its own process, as an S3 endpoint is another machine) (ranged GETs, with and without the read-ahead), against what an 8B model's step consumes on
  one H100 (6 * 8e9 FLOPs per token at 40% of 989 TFLOP/s bf16: ~8,200 tokens/s).
- rss: a reader's resident memory after the same 4,000 windows from a 1x and a 10x corpus (subprocesses).
- wait: the time a step of the tiny GPT (seq_len 64, micro-batch 8) waits for its batch, as a share of the
  step, local and on S3, measured through the step loop's own read-ahead (data/prefetch.py, called as
  worker/loop.py calls it: the next step's batch read and stacked in a thread while this step computes); the
  share is the steady state (steps after the first), the first step's own read is reported apart. It runs in a
  fresh process, as a worker does (not beside this one's Ray driver and S3 clients).
Targets (issue 37): data wait <= 1% of the step on the tiny job; RSS flat in corpus size (10x within 10%);
prepare on Ray >= 1.6x one process on 2 cores. Default runtime about 2-4 minutes on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from elastictrain.data.prepare import prepare  # noqa: E402
from elastictrain.data.windows import PreparedWindows  # noqa: E402

H100_8B_TOKENS_PER_S = 0.40 * 989e12 / (6 * 8e9)


def write_docs(where: Path, copies: int, files: int) -> Path:
    """The docs text ``copies`` times over ``files`` JSON-lines files (documents dealt round-robin)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    where.mkdir(parents=True)
    docs = [f"{topics[k]} ({c})" for c in range(copies) for k in keys]
    for f in range(files):
        with open(where / f"part-{f:03d}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": d}) + "\n" for d in docs[f::files])
    return where


def make_corpus(root: Path, copies: int, files: int) -> tuple[Path, Path]:
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    keys = sorted(topics)
    write_docs(root / "corpus", copies, files)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator((topics[k] for k in keys), trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<|endoftext|>", "<unk>"], show_progress=False))
    tok.save(str(root / "tokenizer.json"))
    return root / "corpus", root / "tokenizer.json"


def bench_prepare(root: Path, corpus: Path, tok: Path) -> dict:
    import ray

    t = time.perf_counter()
    one = prepare(str(corpus), str(tok), str(root / "one"), local_process=True)
    one_s = time.perf_counter() - t
    cpus = len(os.sched_getaffinity(0))
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="WARNING")
    # Ray's worker processes started (and their imports done) once, on a small corpus of one file per CPU: the
    # timed run is the steady state a GB-TB corpus sees, not Ray's start
    prepare(str(write_docs(root / "warm-corpus", 1, cpus)), str(tok), str(root / "warm"), progress=False)
    t = time.perf_counter()
    prepare(str(corpus), str(tok), str(root / "ray"), progress=False)
    ray_s = time.perf_counter() - t
    ray.shutdown()
    same = all((root / "one" / p.relative_to(root / "ray")).read_bytes() == p.read_bytes()
               for p in (root / "ray").rglob("*") if p.is_file())
    tokens = one["splits"]["train"]["tokens"]
    return {"tokens": tokens, "one_process_tokens_per_s": tokens / one_s, "ray_tokens_per_s": tokens / ray_s,
            "ray_speedup": one_s / ray_s, "identical": same, "cpus": cpus}


def read_rate(w: PreparedWindows, n: int, ahead: bool) -> float:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, len(w), n)
    t = time.perf_counter()
    for k in range(0, n, 16):
        if ahead:
            w.prefetch([ids[k:k + 16], ids[k + 16:k + 32]])  # this batch of 16 and the next
        for i in ids[k:k + 16]:
            w[int(i)]
    return n * (w.seq_len + 1) / (time.perf_counter() - t)


class _MotoProcess:
    """moto's S3 server in its own process, as a real S3 endpoint is on another machine: in this process its
    thread would take Python's interpreter lock from the step it serves."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import socket

        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start on 127.0.0.1:{port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def start_s3(root: Path) -> tuple[object, dict, str]:
    import socket

    import s3fs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = _MotoProcess(port)
    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
            "skip_instance_cache": True}
    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir("bench")
    for p in root.rglob("*"):
        if p.is_file():
            fs.pipe_file(f"bench/corpus/{p.relative_to(root)}", p.read_bytes())
    return server, opts, "s3://bench/corpus"


def bench_read(prepared: Path, s3: tuple | None) -> dict:
    out = {"local_tokens_per_s": read_rate(PreparedWindows(str(prepared), 1024), 2000, False)}
    if s3:
        _, opts, uri = s3
        out["s3_tokens_per_s"] = read_rate(PreparedWindows(uri, 1024, storage_options=opts), 300, False)
        out["s3_read_ahead_tokens_per_s"] = read_rate(PreparedWindows(uri, 1024, storage_options=opts), 300, True)
    out["h100_8b_tokens_per_s"] = H100_8B_TOKENS_PER_S
    out.update({f"{k}_vs_8b_h100": v / H100_8B_TOKENS_PER_S for k, v in list(out.items()) if k.endswith("_per_s")
                and not k.startswith("h100")})
    return out


_RSS_PROBE = r"""
import json, sys, numpy as np
sys.path.insert(0, sys.argv[2])
from elastictrain.data.windows import PreparedWindows
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
w = PreparedWindows(sys.argv[1], 64)
for i in np.random.default_rng(0).integers(0, len(w), 4000):
    w[int(i)]
print(json.dumps({"rss_kib": rss(), "windows": len(w)}))
"""


def bench_rss(root: Path, tokens: int) -> dict:
    from elastictrain.data.shards import Shard, manifest_json

    out = {}
    for name, n in (("1x", tokens), ("10x", 10 * tokens)):
        d = root / f"rss{name}"
        (d / "train").mkdir(parents=True)
        data = np.random.default_rng(1).integers(0, 2048, n, dtype=np.uint16).astype("<u2").tobytes()
        (d / "train" / "00000.bin").write_bytes(data)
        (d / "manifest.json").write_text(manifest_json(
            dtype="uint16", vocab_size=2048, eos_id=0, tokenizer_sha256="0" * 64, text_column="text", sources=[],
            splits={"train": [Shard("train/00000.bin", n, len(data), "0" * 64)]}, split_rule={"kind": "none"},
            seq_len=None))
        r = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(d), os.path.join(os.path.dirname(__file__), "..")],
                           capture_output=True, text=True, check=True)
        out[name] = {"tokens": n, **json.loads(r.stdout)}
    out["ratio_10x_to_1x"] = out["10x"]["rss_kib"] / out["1x"]["rss_kib"]
    return out


def wait_in_a_fresh_process(prepared: Path, s3: tuple | None) -> dict:
    """:func:`bench_wait` in a new interpreter, as a worker process is: this one holds what the earlier
    figures left (a Ray driver shut down, S3 clients and their event-loop thread) that no worker has."""
    r = subprocess.run([sys.executable, __file__, "--wait-of", str(prepared),
                        "--wait-s3", json.dumps(None if s3 is None else [s3[1], s3[2]])],
                       capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.path.join(
                           os.path.dirname(os.path.abspath(__file__)), "..")})
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_wait(prepared: Path, s3: tuple | None, steps: int = 30, read_ahead_steps: int = 2) -> dict:
    """What the tiny job's step (seq_len 64, micro-batch 8, one process) waits for its data, as a share of the
    step, through the step loop's own read-ahead (data/prefetch.py ``BatchPrefetcher``) called as the loop calls
    it (worker/loop.py ``_read_ahead`` and ``_LoopHooks.load``): at the start of step ``s`` schedule this step's
    and the next ``read_ahead_steps`` steps' micro-batches (``train.read_ahead_steps``, 2 by default), then
    ``take`` the batch; the wait is the time in ``take`` (the loop's "data"
    phase). The share is over the steps after the first (the steady state); the first step of a run (or of a
    generation) reads its own batch, as nothing was scheduled before it: reported apart as ``first_wait_ms``."""
    import torch

    from elastictrain.data.cursor import rank_micro_batches
    from elastictrain.data.prefetch import BatchPrefetcher
    from elastictrain.models.gpt import GPT, GPTConfig, per_sample_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=2048, seq_len=64, n_layer=2, n_head=2, d_model=64, dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sources = {"local": PreparedWindows(str(prepared), 64)}
    if s3:
        sources["s3"] = PreparedWindows(s3[2], 64, storage_options=s3[1])
    out = {}
    for name, w in sources.items():
        ahead = BatchPrefetcher(w, lambda items: {k: torch.stack([it[k] for it in items]) for k in items[0]},
                                batch=w.batch)  # as the loop builds it for the default collate
        wait = total = first = 0.0
        try:
            for s in range(steps + 1):
                t0 = time.perf_counter()
                (ids,) = rank_micro_batches(s, 0, 1, 8, 8, 0, len(w))
                ahead.schedule([ids] + [rank_micro_batches(t, 0, 1, 8, 8, 0, len(w))[0]
                                        for t in range(s + 1, min(s + 1 + read_ahead_steps, steps + 1))])
                t = time.perf_counter()
                batch = ahead.take(ids)
                waited = time.perf_counter() - t
                loss = per_sample_loss(model(batch["input"]), batch["target"]).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                if s == 0:
                    first = waited
                else:
                    wait, total = wait + waited, total + time.perf_counter() - t0
        finally:
            ahead.close()
            w.close()
        out[f"{name}_wait_share"] = wait / total
        out[f"{name}_step_ms"] = 1e3 * total / steps
        out[f"{name}_first_wait_ms"] = 1e3 * first
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 160 copies: ~20 M tokens, ~30 s in one process; at 1 M tokens Ray Data's fixed costs were most of its time
    ap.add_argument("--copies", type=int, default=160, help="times the docs text is repeated in the corpus "
                    "(160: ~20 M tokens)")
    ap.add_argument("--files", type=int, default=8, help="JSON-lines files (one prepare task each)")
    ap.add_argument("--no-s3", action="store_true", help="skip the moto S3 measurements")
    ap.add_argument("--rss-tokens", type=int, default=4_000_000, help="tokens of the 1x corpus of the RSS check")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--wait-of", default=None, help=argparse.SUPPRESS)  # (wait_in_a_fresh_process's child)
    ap.add_argument("--wait-s3", default="null", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.wait_of:
        s3 = json.loads(args.wait_s3)
        import torch

        torch.set_num_threads(1)  # one intra-op thread, as the tiny job's workers on this machine (1 CPU each)
        print(json.dumps(bench_wait(Path(args.wait_of), None if s3 is None else (None, s3[0], s3[1]))))
        return
    # one thread for the one-process side (set before `tokenizers` starts its pool: training the tokenizer
    # would start it with every core), as each Ray task has: the pair compares processes, not thread pools
    os.environ["RAYON_NUM_THREADS"] = "1"
    root = Path(tempfile.mkdtemp(prefix="et-data-bench-"))
    s3 = None
    try:
        corpus, tok = make_corpus(root, args.copies, args.files)
        figures = {"prepare": bench_prepare(root, corpus, tok)}
        if not args.no_s3:
            s3 = start_s3(root / "one")
        figures["read"] = bench_read(root / "one", s3)
        figures["rss"] = bench_rss(root, args.rss_tokens)
        figures["wait"] = wait_in_a_fresh_process(root / "one", s3)
    finally:
        if s3:
            s3[0].stop()
        shutil.rmtree(root, ignore_errors=True)
    p, r, m, w = figures["prepare"], figures["read"], figures["rss"], figures["wait"]
    print(f"prepare: {p['tokens']:,} tokens; one process {p['one_process_tokens_per_s']:,.0f} tok/s, Ray "
          f"{p['ray_tokens_per_s']:,.0f} tok/s on {p['cpus']} CPUs ({p['ray_speedup']:.2f}x; target >= 1.6x); "
          f"identical bytes: {p['identical']}")
    for k, v in r.items():
        print(f"read: {k} = {v:,.2f}")
    print(f"rss: 1x {m['1x']['rss_kib']:,} KiB, 10x {m['10x']['rss_kib']:,} KiB (ratio {m['ratio_10x_to_1x']:.3f}; "
          "target <= 1.10)")
    for k, v in w.items():
        print(f"wait: {k} = {v:.4f}" + ("  (steps after the first; target <= 0.01)" if k.endswith("share") else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
