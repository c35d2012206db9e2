"""Prepared corpora (issue 37): `elastictrain data prepare` on Ray Data with a tokenizer trained here (nothing
downloaded), its bytes a pure function of the inputs, resume, bad input, and training on it by range reads:
the sample audit, a SIGKILLed worker, a resume at another world size, S3 through moto, memory flat in corpus
size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from elastictrain.data.prepare import PrepareError, prepare
from elastictrain.data.shards import Shard, manifest_json, read_manifest
from elastictrain.data.windows import PreparedWindows
from tests.checkpoint_fixtures import s3_bucket, s3_server  # noqa: F401 - fixtures
from tests.conftest import job, run_job

ROOT = Path(__file__).resolve().parents[1]
SEQ = 32


def _corpus(where: Path) -> Path:
    """Python's docs (the built-in corpus's text) as 4 JSON-lines files, one document per topic."""
    from pydoc_data.topics import topics

    where.mkdir(parents=True)
    keys = sorted(topics)
    for f in range(4):
        with open(where / f"part-{f}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": topics[k]}) + "\n" for k in keys[f::4])
    return where


def _tokenizer(path: Path) -> Path:
    """A byte-level BPE of 300 ids trained on the built-in corpus, with <|endoftext|> (id 0)."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"], show_progress=False)
    tok.train_from_iterator((topics[k] for k in sorted(topics)), trainer)
    tok.save(str(path))
    return path


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The corpus prepared once through Ray Data (``a``), with a 10% validation split. (A second Ray Data
    prepare, only to compare with the first, cost the module ~20 CPU-s: the run twice is the Ray run and
    the in-order one-process run of the test below, whose bytes are the reference either way.)"""
    from tests.conftest import _ensure_local_ray

    _ensure_local_ray()
    tmp = tmp_path_factory.mktemp("prepared")
    corpus, tok = _corpus(tmp / "corpus"), _tokenizer(tmp / "tokenizer.json")
    prepare(str(corpus), str(tok), str(tmp / "a"), val_fraction=0.1, seq_len=SEQ, progress=False)
    return tmp


def test_prepare_on_ray_twice_is_byte_identical_and_one_process_agrees(prepared, tmp_path):
    """Prepared twice, at two times and two ways: on Ray Data (its 4 units in tasks that finish in any
    order) and in this process, the units in order, without Ray: the same bytes, so the output depends on
    neither the scheduling nor the run (a time, a random name, a completion order in it would differ). One
    Ray run against the in-order reference is the stronger check of the two: two Ray runs could agree on
    the same wrong order. Broken on purpose (2026-11-28, failing here): the manifest stamped with the
    time of the run."""
    a = _files(prepared / "a")
    assert "manifest.json" in a and len(a) == 1 + 4 * 4  # manifest; 2 splits x 4 x (shard + record)
    prepare(str(prepared / "corpus"), str(prepared / "tokenizer.json"), str(tmp_path / "c"), val_fraction=0.1,
            seq_len=SEQ, local_process=True)
    assert _files(tmp_path / "c") == a
    m = read_manifest(str(prepared / "a"))
    assert m.vocab_size == 300 and m.dtype == "uint16" and m.eos_id == 0
    assert [s.name for s in m.splits["train"]] == [f"train/0000{i}.bin" for i in range(4)]
    # the manifest's figures are the files' own, and every document ends with the end token
    for shard in m.splits["train"] + m.splits["validation"]:
        data = (prepared / "a" / shard.name).read_bytes()
        assert len(data) == shard.bytes == 2 * shard.tokens
        assert shard.tokens == 0 or np.frombuffer(data, "<u2")[-1] == 0
    assert m.tokens("validation") > 0.03 * m.tokens("train")


def test_interrupted_prepare_resumes_and_skips_verified_shards(prepared, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(prepared / "a", out)
    (out / "manifest.json").unlink()  # interrupted before the manifest: not a corpus yet
    (out / "train" / "00002.bin").unlink()  # a shard never written
    bad = out / "validation" / "00001.bin"
    bad.write_bytes(bad.read_bytes()[:-2] + b"\x01\x00")  # a shard whose bytes do not match its record
    with pytest.raises(ValueError, match="manifest.json not found"):
        PreparedWindows(str(out), SEQ)
    m = prepare(str(prepared / "corpus"), str(prepared / "tokenizer.json"), str(out), val_fraction=0.1,
                seq_len=SEQ, local_process=True)
    assert m["_skipped"] == 2  # files 0 and 3: both their shards verified by SHA-256; 1 and 2 redone
    assert _files(out) == _files(prepared / "a")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastictrain", "data", "prepare", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _in_process(*args: str) -> subprocess.CompletedProcess:
    """`elastictrain data prepare ARGS` through click in this process (from the repository root, as
    :func:`_cli`): the same argv, exit code and stderr, without a subprocess's imports (~2 CPU-s each)."""
    from click.testing import CliRunner

    from elastictrain.cli import main

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        r = CliRunner().invoke(main, ["data", "prepare", *args], catch_exceptions=False)
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


def test_bad_input_is_one_line_and_exit_2(prepared, tmp_path):
    """Every case fails before Ray starts: one line naming the problem and the fix, exit 2. The first case
    runs as a user types it (a process of its own: nothing else reaches its stderr, no traceback); the others
    run the same argv through click in this process."""
    tok, corpus = str(prepared / "tokenizer.json"), str(prepared / "corpus")
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text("")
    cases = {
        "no such source": (str(tmp_path / "nope"), tok),
        "unreadable tokenizer": (corpus, str(tmp_path / "bad.json")),
        "cannot read tokenizer": (corpus, str(tmp_path / "missing.json")),
        "column 'body' not found": (corpus, tok, "--text-column", "body"),
        "empty corpus": (str(tmp_path / "empty"), tok),
    }
    for i, (needle, (source, tokenizer, *rest)) in enumerate(cases.items()):
        r = (_cli if i == 0 else _in_process)(source, "--tokenizer", tokenizer, "--out", str(tmp_path / "out"), *rest)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (needle, r.stderr)
        assert "Traceback" not in r.stderr and not (tmp_path / "out" / "manifest.json").exists()


def test_a_corpus_of_empty_documents_is_refused(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jsonl").write_text('{"text": ""}\n{"text": null}\n')
    with pytest.raises(PrepareError, match="empty corpus"):
        prepare(str(tmp_path / "c"), str(_tokenizer(tmp_path / "t.json")), str(tmp_path / "o"), local_process=True)
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_windows_are_the_token_stream_sliced(prepared):
    """Sample i is tokens [i*seq, i*seq + seq + 1) of the shards concatenated, across shard boundaries."""
    w = PreparedWindows(str(prepared / "a"), SEQ)
    stream = np.concatenate([np.fromfile(prepared / "a" / s.name, "<u2") for s in w.shards]).astype(np.int64)
    assert len(w) == (len(stream) - 1) // SEQ
    for i in [0, 1, w.starts[1] // SEQ, w.starts[2] // SEQ, len(w) - 1]:
        x = stream[i * SEQ: i * SEQ + SEQ + 1]
        assert w[i]["input"].tolist() == x[:-1].tolist() and w[i]["target"].tolist() == x[1:].tolist()
    with pytest.raises(IndexError):
        w[len(w)]


# ---------------------------------------------------------------------------------------------- training


def _spec(source: str, **train) -> dict:
    """The training job on a prepared corpus: 8 steps of the GPT with 2 blocks (one per stage of pp2, so
    every layout trains the same model and the ddp run is every layout's reference), the held-out loss after
    steps 4 and 8."""
    task = {**job()["task"], "data": {"source": source}}
    task["model"] = {**task["model"], "seq_len": SEQ, "n_layer": 2}
    return job(task=task, train={"steps": 8, "audit_samples": True, "eval_every": 4, "eval_batches": 2, **train})


def _audit(run, steps: int, n: int) -> None:
    from elastictrain.data.cursor import step_sample_ids

    seen: dict[int, list[int]] = {}
    for e in run.of("step"):
        ids = sorted(e["sample_ids"])
        assert ids == sorted(step_sample_ids(e["step"] - 1, 16, 0, n).tolist()), e["step"]
        assert len(set(ids)) == len(ids) == 16
        assert seen.setdefault(e["step"], ids) == ids
    assert sorted(seen) == list(range(1, steps + 1))


def test_ddp_on_prepared_data_survives_a_sigkill_then_resumes_at_another_size(prepared, tmp_path, ray_local,
                                                                               clean_run):
    """2 workers, rank 1 SIGKILLed in step 4: every step's samples once, losses (and the held-out losses at
    steps 4 and 8) equal to an uninterrupted run step by step; the run's checkpoint at step 4 resumed on 1
    worker continues the same sample sequence with the same losses and eval loss (to float summation order)."""
    source = str(prepared / "a")
    n = len(PreparedWindows(source, SEQ))
    clean = clean_run(_spec(source))
    ck = {"uri": str(tmp_path / "ckpt"), "every_steps": 4, "when_busy": "wait"}
    kill = {"rank": 1, "step": 4, "point": "mid_step", "kind": "kill"}
    # strict mode: the replacement rejoins before step 4 is redone, so every step runs at world size 2 and
    # the losses are bitwise those of the clean run (elastic mode would run some steps on the survivor alone)
    faulty = run_job(tmp_path, _spec(source) | {"checkpoint": {**job()["checkpoint"], **ck}, "faults": [kill],
                                                "recovery": {"mode": "strict"}}, name="faulty")
    assert faulty.result.exit_code == 0 and faulty.of("failure"), faulty.summary
    _audit(faulty, 8, n)
    assert faulty.losses() == clean.losses()
    evals = {e["step"]: e["eval_loss"] for e in clean.of("step") if "eval_loss" in e}
    assert sorted(evals) == [4, 8] and evals[8] < evals[4] < 6.0  # ln(300) = 5.7: it learned
    assert {e["step"]: e["eval_loss"] for e in faulty.of("step") if "eval_loss" in e} == evals
    assert clean.summary["final_eval_loss"] == evals[8]
    from elastictrain.report import build_view, render_html

    view = build_view(clean.events, clean.summary)
    assert [v for _, v in view["eval_loss"]] == [evals[4], evals[8]]
    assert "final eval loss" in render_html(view) and "eval loss (dashed)" in render_html(view)
    assert faulty.summary["final_model_sha256"] == clean.summary["final_model_sha256"]
    # the step-4 commit resumed at world size 1 (the retained step 8 removed: resume from 4)
    import shutil

    for d in (tmp_path / "ckpt").rglob("step_*8"):
        shutil.rmtree(d)
    one = run_job(tmp_path, _spec(source) | {"checkpoint": {**job()["checkpoint"], **ck},
                                             "workers": {**job()["workers"], "min": 1, "max": 1}}, name="one")
    (resumed,) = one.of("resumed")
    assert resumed["step"] == 4 and resumed["world_size"] == 1, resumed
    _audit_from(one, 5, 8, n)
    for step in range(5, 9):
        assert abs(one.losses()[step] - clean.losses()[step]) <= 1e-5 * abs(clean.losses()[step])
    (last,) = [e for e in one.of("step") if e["step"] == 8]
    assert abs(last["eval_loss"] - evals[8]) <= 1e-5 * evals[8]  # the same windows at world size 1


def _audit_from(run, first: int, last: int, n: int) -> None:
    from elastictrain.data.cursor import step_sample_ids

    got = {e["step"]: sorted(e["sample_ids"]) for e in run.of("step")}
    assert sorted(got) == list(range(first, last + 1))
    for step, ids in got.items():
        assert ids == sorted(step_sample_ids(step - 1, 16, 0, n).tolist())


def test_resume_over_another_corpus_is_refused_naming_both(prepared, tmp_path):
    from elastictrain.checkpoint.compat import compare

    other = tmp_path / "other"
    import shutil

    shutil.copytree(prepared / "a", other)
    raw = json.loads((other / "manifest.json").read_text())
    raw["tokenizer"]["sha256"] = "f" * 64  # the same ids from another tokenizer
    (other / "manifest.json").write_text(json.dumps(raw))
    from elastictrain.data.fingerprint import dataset_fingerprint

    a, b = dataset_fingerprint(PreparedWindows(str(prepared / "a"), SEQ)), dataset_fingerprint(
        PreparedWindows(str(other), SEQ))
    (diff,) = compare({"data": a}, {"data": b}, keys=("data",))
    assert a["tokenizer"] in diff.line and "ffffffff" in diff.line and "in the checkpoint" in diff.line


def test_vocab_comes_from_the_manifest_and_a_smaller_one_is_a_config_error(prepared):
    from elastictrain import build_config
    from elastictrain.config import ConfigError
    from elastictrain.task import builtin_task

    spec = _spec(str(prepared / "a"))
    assert builtin_task(build_config(spec)).model_fn().tok_emb.num_embeddings == 300
    assert builtin_task(build_config(job())).model_fn().tok_emb.num_embeddings == 256  # bytes
    spec["task"]["model"]["vocab_size"] = 512
    assert builtin_task(build_config(spec)).model_fn().tok_emb.num_embeddings == 512
    spec["task"]["model"]["vocab_size"] = 256
    with pytest.raises(ConfigError, match="vocab_size=256 is smaller than the data's vocabulary 300"):
        builtin_task(build_config(spec))


def _manifest_only(root: Path, vocab_size: int) -> str:
    """A prepared directory of one tiny shard whose manifest declares ``vocab_size``."""
    (root / "train").mkdir(parents=True)
    (root / "train" / "00000.bin").write_bytes(bytes(200))
    (root / "manifest.json").write_text(manifest_json(
        dtype="uint16", vocab_size=vocab_size, eos_id=0, tokenizer_sha256="0" * 64, text_column="text", sources=[],
        splits={"train": [Shard("train/00000.bin", 100, 200, "0" * 64)]}, split_rule={"kind": "none"}, seq_len=None))
    return str(root)


@pytest.mark.parametrize("task", [{"model": {"seq_len": SEQ, "n_head": 2, "d_model": 32}},
                                  {"kind": "llama", "model": {"seq_len": SEQ}}], ids=["gpt", "llama"])
def test_tp_that_does_not_divide_the_manifests_vocab_is_a_config_error(tmp_path, task):
    """task.model.vocab_size null: the config check reads the prepared corpus's vocabulary from its manifest,
    so tp2 over 301 ids is one line naming the manifest's size, the valid tp values and the padded size (the
    byte default 256 would have passed it, and the run failed at its start); 302 passes, and so does 301 with
    a padded task.model.vocab_size."""
    from elastictrain import build_config
    from elastictrain.config import ConfigError

    def spec(source: str, **model) -> dict:
        return job(task={**task, "model": {**task["model"], **model}, "data": {"source": source}},
                   workers={"min": 2, "max": 2}, parallel={"tp": 2})

    odd = _manifest_only(tmp_path / "odd", 301)
    with pytest.raises(ConfigError) as e:
        build_config(spec(odd))
    line = str(e.value)
    assert "\n" not in line and "manifest" in line and "=301" in line, line
    assert "valid parallel.tp values for this model: [1]" in line and "task.model.vocab_size=302" in line, line
    assert build_config(spec(_manifest_only(tmp_path / "even", 302))).parallel.tp == 2
    assert build_config(spec(odd, vocab_size=302)).task.model.vocab_size == 302


def test_eval_needs_a_validation_split_under_any_layout(prepared, tmp_path):
    import shutil

    from elastictrain import build_config
    from elastictrain.config import ConfigError
    from elastictrain.task import builtin_task

    with pytest.raises(ConfigError, match="needs a validation split .* none \\(not a prepared corpus\\)"):
        builtin_task(build_config(job(train={"eval_every": 2})))
    no_val = tmp_path / "noval"
    shutil.copytree(prepared / "a", no_val)
    raw = json.loads((no_val / "manifest.json").read_text())
    del raw["splits"]["validation"]
    (no_val / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="has 0 validation tokens"):
        builtin_task(build_config(_spec(str(no_val))))
    for parallel in ({"pp": 2}, {"tp": 2}):  # every layout evaluates (tests/test_eval_layouts.py)
        spec = _spec(str(prepared / "a")) | {"parallel": parallel, "workers": {"min": 2, "max": 2}}
        assert builtin_task(build_config(spec)).eval_dataset_fn is not None


def test_eval_ids_are_the_same_windows_at_any_world_size():
    from elastictrain.data.cursor import eval_sample_ids

    def batch(j: int, world: int, micro: int) -> list[int]:
        return sorted(int(i) for r in range(world) for k in range(16 // (world * micro))
                      for i in eval_sample_ids(j, r, world, micro, 16, k, 40))

    assert batch(0, 1, 4) == batch(0, 2, 4) == batch(0, 4, 2) == list(range(16))
    assert batch(2, 2, 8) == sorted(i % 40 for i in range(32, 48))  # wraps around the split


def test_eval_loss_on_the_console_and_in_the_report_view():
    from elastictrain.events import format_event

    line = format_event({"event": "step", "time": 0.0, "step": 4, "total_steps": 8, "loss": 5.0, "world_size": 2,
                         "samples_per_s": 10.0, "eval_loss": 4.25})
    assert line.endswith("eval_loss 4.2500")


# ----------------------------------------------------------------------------------------------------- S3


def test_s3_ranged_reads_match_local_windows(prepared, s3_server, s3_bucket):
    """The prepared corpus uploaded to moto's S3: windows read by ranged GETs (a batch's in one coalesced
    read, with the read-ahead) equal the local ones, and the fingerprint (from the manifest) is the same."""
    import s3fs

    opts = s3_server.options()
    fs = s3fs.S3FileSystem(**opts)
    for rel, data in _files(prepared / "a").items():
        fs.pipe_file(f"{s3_bucket}/corpus/{rel}", data)
    local = PreparedWindows(str(prepared / "a"), SEQ)
    remote = PreparedWindows(f"{s3_bucket}/corpus", SEQ, storage_options=opts)
    assert not remote.local and remote.fingerprint() == local.fingerprint()
    ids = [0, 7, local.starts[1] // SEQ, len(local) - 1]
    remote.prefetch([ids, [3]])
    for i in ids:
        assert remote[i]["input"].tolist() == local[i]["input"].tolist()
    assert remote.batch(ids)["target"].tolist() == local.batch(ids)["target"].tolist()
    assert set(remote._ahead) == {(3,)}  # the taken batch is gone
    remote.prefetch([[9]])  # the unused 3 is dropped: what waits is what was last asked for
    assert set(remote._ahead) == {(9,)}
    remote.close()


def test_prepare_from_and_to_s3_gives_the_same_bytes(prepared, s3_server, s3_bucket):
    """Source files on S3 and the output on S3 (the units in this process: the Ray path is the same
    function): the objects are byte for byte the local output, the manifest included."""
    import s3fs

    opts = s3_server.options()
    fs = s3fs.S3FileSystem(**opts)
    for p in sorted((prepared / "corpus").iterdir()):
        fs.pipe_file(f"{s3_bucket}/text/{p.name}", p.read_bytes())
    prepare(f"{s3_bucket}/text", str(prepared / "tokenizer.json"), f"{s3_bucket}/out", val_fraction=0.1,
            seq_len=SEQ, storage_options=opts, local_process=True)
    local = _files(prepared / "a")
    assert {rel: fs.cat_file(f"{s3_bucket}/out/{rel}") for rel in local} == local


def test_training_reads_the_corpus_from_s3(prepared, s3_server, s3_bucket, tmp_path, ray_local, clean_run):
    """The prepared corpus on moto's S3: 2 workers read their windows by ranged GETs (read-ahead on): the
    first 4 steps (inside the warm-up: the schedule does not depend on train.steps) and the held-out loss
    at step 4 are bitwise those of the run on the local copy."""
    import s3fs

    opts = s3_server.options()
    fs = s3fs.S3FileSystem(**opts)
    for rel, data in _files(prepared / "a").items():
        fs.pipe_file(f"{s3_bucket}/corpus/{rel}", data)
    spec = _spec(f"{s3_bucket}/corpus", steps=4)
    spec["task"]["data"]["storage_options"] = opts
    run = run_job(tmp_path, spec, name="s3")
    assert run.result.exit_code == 0, run.summary
    clean = clean_run(_spec(str(prepared / "a")))
    assert run.losses() == {s: clean.losses()[s] for s in range(1, 5)}
    assert [e["eval_loss"] for e in run.of("step") if "eval_loss" in e] == [
        e["eval_loss"] for e in clean.of("step") if e["step"] == 4]
    _audit(run, 4, len(PreparedWindows(str(prepared / "a"), SEQ)))


# Timeouts for a loaded 2-core machine: the survivor of a killed pipeline or fsdp step can take longer than
# 15 s to leave it (tests/test_pp_recovery.py), and a stalled read's hang bound (10x a step's time) can pass
# 15 s, when the peers' collective would time out before the stall is named. The order collective < watchdog
# cap < poll < restart grace is kept.
_LOADED_TIMEOUTS = {**job()["timeouts"], "collective_s": 60, "step_watchdog_cap_s": 70, "poll_s": 80,
                     "watchdog_floor_s": 10, "restart_grace_s": 240}


def _shard_gets(w: PreparedWindows, steps: range, world: int, micro: int, batch: int) -> int:
    """The ranged GETs of every micro-batch of ``steps`` (0-based) of every rank, each batch read once in one
    coalesced ``cat_ranges`` call (elastictrain/byte_ranges.py's plan, as ``PreparedWindows.read_windows``)."""
    from elastictrain.byte_ranges import plan_reads
    from elastictrain.data.cursor import rank_micro_batches

    size = w.dtype.itemsize
    total = 0
    for s in steps:
        for r in range(world):
            for ids in rank_micro_batches(s, r, world, micro, batch, 0, len(w)):
                pieces = [(str(k), lo * size, hi * size) for i in ids
                          for k, lo, hi in w._pieces(int(i) * SEQ, (int(i) + 1) * SEQ + 1)]
                total += len(plan_reads(pieces, w.merge_gap)[0])
    return total


@pytest.mark.slow  # its own moto server, stalled for a hang bound
def test_a_stalled_s3_read_is_named_and_costs_no_step(prepared, tmp_path, ray_local, clean_run):
    """2 workers train on the corpus on moto's S3 server through a relay (tests/s3_gate.py) that holds
    every read of a shard after those of steps 1-5 (and each worker's sample-length probe): the stall
    starts at a read the count fixes, whatever the machine's speed, a batch of step 6 or later (read ahead
    from step 4 on), so steps were timed for the hang bound. The controller names the stall
    (`data_stalled`: storage, not a worker, past the hang bound) and replaces nobody; once the reads are
    released the run finishes with every step's samples once and the losses of the run on the local copy.
    (It stopped the server with SIGSTOP once the run reported step 2: a run whose read-ahead had read its
    last steps by then never stalled.) Broken on purpose (2026-11-28, failing here): the loop reading its
    batches in phase ``compute`` instead of ``data``: no `data_stalled` within 240 s."""
    import s3fs

    from tests.checkpoint_fixtures import MotoProcess
    from tests.conftest import BackgroundRun
    from tests.s3_gate import S3Gate

    local = PreparedWindows(str(prepared / "a"), SEQ)
    after = _shard_gets(local, range(5), 2, 4, 16) + 2  # + each worker's probe of window 0 (one read)
    moto = MotoProcess()
    gate = S3Gate(moto.port, after=after)
    try:
        fs = s3fs.S3FileSystem(**moto.options())
        fs.mkdir("stall")
        for rel, data in _files(prepared / "a").items():
            fs.pipe_file(f"s3://stall/corpus/{rel}", data)
        opts = moto.options()
        opts["client_kwargs"] = {"endpoint_url": gate.endpoint}
        spec = _spec("s3://stall/corpus", eval_every=0)  # the training reads stall (evaluation adds none)
        spec["task"]["data"]["storage_options"] = opts
        # steps of ~0.3 s (a slow fault on both ranks) or more: a hang bound of >= 10 s once steps were timed
        spec["faults"] = [{"rank": r, "step": 1, "kind": "slow", "seconds": 0.3, "generation": None} for r in (0, 1)]
        spec["timeouts"] = dict(_LOADED_TIMEOUTS)
        bg = BackgroundRun(tmp_path, spec, name="stalled")
        try:
            named = bg.wait_for(lambda e: e["event"] == "data_stalled", timeout=240)
        finally:
            gate.release()
        run = bg.finish(timeout=180)
    finally:
        gate.close()
        moto.stop()
    assert gate.held.is_set() and gate.reads > after, (gate.reads, after)
    assert named["step"] >= 4 and named["rank"] in (0, 1), named
    assert named["waited_s"] > named["bound_s"] and "storage" in named["reason"], named
    assert run.result.exit_code == 0 and not run.of("failure") and not run.of("stall_aborted"), run.summary
    assert run.losses() == clean_run(_spec(str(prepared / "a"))).losses()
    _audit(run, 8, len(local))


@pytest.mark.slow  # a kill, a replacement process and a keeper: ~30-90 s under load
@pytest.mark.parametrize("parallel", [{"plan": "fsdp"}, {"plan": "ddp", "pp": 2}], ids=["fsdp", "pp2"])
def test_fsdp_and_pp2_on_prepared_data_survive_a_sigkill(prepared, tmp_path, ray_local, clean_run, parallel):
    """2 workers under fsdp (each holds half of every block) or a 2-stage pipeline (each holds one stage),
    rank 1 SIGKILLed mid-step 6: no survivor holds its state, the peer memory tier (a snapshot every step)
    does, and the replacement loads it from the keeper (strict: every step at world size 2). Every sample of
    every step once, and every step's loss (each report of a redone step counts), the held-out losses at
    steps 4 and 8 (the pipeline's by a forward-only pass of its schedule) and the final parameters those of
    the uninterrupted ddp run the ddp test trains (the same model and data: the reference is shared, these
    runs add no clean run). Tolerance: tests/parallel_fixtures.py's (1e-5 relative on losses, 1e-4 on
    parameters after a recovery): fsdp's reduce-scatter and sharded clip norm, and pp2's gradients
    accumulated over 4 micro-batches on one data rank, sum the same numbers in another order (measured
    2026-11-28: losses within 3e-8 relative, parameters within 4.4e-6 of ddp's; the final digests differ,
    so the parameters are compared by value). Not a durable checkpoint: a commit lands a poll or more after
    its save, and in 6 short steps none had (seen: pp2 restarted from step 0).
    Broken on purpose (2026-11-28, both layouts failing here): a restore one step ahead (``TrainingState.
    load_from`` setting the step + 1): step 6 never trained, the audit fails; the evaluation's windows moved
    by the membership generation (``eval_sample_ids(j + generation, ...)``): the held-out loss at step 8,
    after the recovery, off by 8e-5 relative."""
    from tests.parallel_fixtures import RECOVERY_PARAM_ATOL, assert_same_numbers

    source = str(prepared / "a")
    clean = clean_run(_spec(source))
    kill = {"rank": 1, "step": 6, "point": "mid_step", "kind": "kill"}
    slow = [{"rank": r, "step": 1, "kind": "slow", "seconds": 0.03} for r in range(2)]
    spec = _spec(source) | {
        "parallel": parallel, "workers": {"min": 2, "max": 2, "standby": False, "reuse": True},
        "checkpoint": {**job()["checkpoint"], "memory_every_steps": 1}, "faults": [*slow, kill],
        "recovery": {"mode": "strict", "min_workers_wait_s": 240}, "timeouts": dict(_LOADED_TIMEOUTS)}
    run = run_job(tmp_path, spec, name="killed")
    assert run.result.exit_code == 0 and run.summary["final_step"] == 8, run.summary
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 1)], run.of("failure")
    (rec,) = run.of("recovered")
    # at most two intervals lost: the newest snapshot may still have been in flight (docs/config.md)
    assert rec["source"] == "memory" and rec["lost_steps"] <= 2 and rec["world_size"] == 2, rec
    assert "survivors at step" in rec["reason"] and " lack " in rec["reason"], rec  # no survivor held it
    _audit(run, 8, len(PreparedWindows(source, SEQ)))
    assert_same_numbers(run, clean, param_atol=RECOVERY_PARAM_ATOL)
    want = {e["step"]: e["eval_loss"] for e in clean.of("step") if "eval_loss" in e}
    got = [(e["step"], e["eval_loss"]) for e in run.of("step") if e.get("eval_loss") is not None]
    assert sorted({s for s, _ in got}) == sorted(want) == [4, 8], got
    assert all(abs(v - want[s]) <= 1e-5 * want[s] for s, v in got), (got, want)


# -------------------------------------------------------------------------------------------- memory flat


_RSS_PROBE = r"""
import json, sys, numpy as np
sys.path.insert(0, sys.argv[2])
from elastictrain.data.windows import PreparedWindows
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
w = PreparedWindows(sys.argv[1], 64)
rng = np.random.default_rng(0)
w[0]; before = rss()
for i in rng.integers(0, len(w), 4000):
    w[int(i)]
print(json.dumps({"before": before, "after": rss(), "len": len(w)}))
"""


def _synthetic(root: Path, tokens: int) -> str:
    shards = []
    rng = np.random.default_rng(1)
    for k in range(4):
        data = rng.integers(0, 300, tokens // 4, dtype=np.uint16).astype("<u2").tobytes()
        name = f"train/{k:05d}.bin"
        (root / "train").mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
        shards.append(Shard(name, len(data) // 2, len(data), "0" * 64))
    (root / "manifest.json").write_text(manifest_json(
        dtype="uint16", vocab_size=300, eos_id=0, tokenizer_sha256="0" * 64, text_column="text", sources=[],
        splits={"train": shards}, split_rule={"kind": "none"}, seq_len=None))
    return str(root)


def test_reading_windows_keeps_rss_flat_in_corpus_size(tmp_path):
    """The same 4,000 random windows read from a 4M-token and a 40M-token corpus (80 MB on disk): the
    reader's resident memory after reading is within 10% between the two (a loaded corpus would add 80 MB)."""
    sizes = {}
    for name, tokens in (("1x", 4_000_000), ("10x", 40_000_000)):
        out = subprocess.run([sys.executable, "-c", _RSS_PROBE, _synthetic(tmp_path / name, tokens), str(ROOT)],
                             capture_output=True, text=True, check=True, timeout=120)
        sizes[name] = json.loads(out.stdout)
    assert sizes["10x"]["len"] > 9 * sizes["1x"]["len"]
    assert sizes["10x"]["after"] <= 1.10 * sizes["1x"]["after"], sizes
