"""`elastictrain report RUN_DIR`: the view built from events, and the page rendered by a real headless
Chromium from a real run with a failure and checkpoints: the screenshot is not blank and shows the series,
and the page's own data (embedded JSON and the visible figures) match summary.json."""

from __future__ import annotations

import html.parser
import json
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from elastictrain.report import build_view, find_chromium, render_html, write_report

T0 = 1000.0


def _events() -> list[dict]:
    ev = [{"event": "run_started", "time": T0, "name": "v", "run_id": "v", "workers_max": 2},
          {"event": "worker_started", "time": T0 + 5, "rank": 0, "slot": 0, "pid": 10, "setup_s": 4.0},
          {"event": "worker_started", "time": T0 + 5, "rank": 1, "slot": 1, "pid": 11, "setup_s": 4.0},
          {"event": "generation_started", "time": T0 + 5, "world_size": 2}]
    ev += [{"event": "step", "time": T0 + 6 + s, "finished_at": T0 + 5.5 + s, "step": s, "loss": 5.0 - s / 10,
            "samples_per_s": 16.0, "world_size": 2, "step_s": 1.0} for s in range(1, 5)]
    ev += [{"event": "failure", "time": T0 + 10, "kind": "hang", "rank": 1, "slot": 1, "step": 4, "reason": "x"},
           {"event": "resized", "time": T0 + 10.5, "old_world_size": 2, "new_world_size": 1},
           {"event": "worker_started", "time": T0 + 14, "rank": 1, "slot": 1, "pid": 12, "setup_s": 3.0},
           {"event": "checkpoint_saved", "time": T0 + 15, "step": 4, "bytes": 100, "write_s": 0.1, "stall_s": 0.01},
           {"event": "checkpoint_skipped", "time": T0 + 16, "step": 5, "reason": "busy"}]
    return ev


def test_view_has_lanes_failures_replacements_and_checkpoints() -> None:
    view = build_view(_events(), {"wall_s": 20.0, "goodput": {"productive_s": 4.0, "other_s": 16.0}})
    slot1 = view["lanes"][1]
    assert [f["kind"] for f in slot1["failures"]] == ["hang"]
    assert [r["pid"] for r in slot1["replacements"]] == [12]
    assert [(s["start"], s["end"]) for s in slot1["segments"]] == [(1.0, 10.0), (11.0, 20.0)]
    assert view["loss"][0] == [6.5, 4.9]  # at the worker's finished_at, not when the driver logged it
    assert view["checkpoints"][0] == {"step": 4, "staged": 9.5, "committed": 15.0, "bytes": 100, "write_s": 0.1,
                                      "stall_s": 0.01, "status": "committed"}
    assert view["checkpoints"][1]["status"] == "skipped"
    assert [m["kind"] for m in view["markers"]] == ["failure", "resized"]
    page = render_html(view)
    assert "http://" not in page.replace("http://www.w3.org", "") and "https://" not in page  # self-contained
    assert "<\\/" not in page.split("report-data")[0]


def _read_png(path: Path) -> np.ndarray:
    """A small PNG decoder (8-bit RGB/RGBA, not interlaced): what Chromium writes. No imaging dependency."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, hdr = 8, [], None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body, pos = data[pos + 8:pos + 8 + n], pos + 12 + n
        if kind == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    w, h, depth, ctype, _, _, interlace = hdr
    assert depth == 8 and interlace == 0 and ctype in (2, 6), hdr
    bpp = 3 if ctype == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(h, 1 + w * bpp)
    out = np.zeros((h, w * bpp), dtype=np.int32)
    prev = np.zeros(w * bpp, dtype=np.int32)
    for y in range(h):
        f, line = int(raw[y, 0]), raw[y, 1:].astype(np.int32)
        if f == 0:
            cur = line
        elif f == 1:
            cur = (np.cumsum(line.reshape(w, bpp), axis=0) & 255).reshape(-1)
        elif f == 2:
            cur = (line + prev) & 255
        else:
            lp, pv, cu = line.tolist(), prev.tolist(), [0] * len(line)
            for i in range(len(lp)):
                a, b = (cu[i - bpp] if i >= bpp else 0), pv[i]
                if f == 3:
                    cu[i] = (lp[i] + ((a + b) >> 1)) & 255
                else:
                    c = pv[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    cu[i] = (lp[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            cur = np.array(cu, dtype=np.int32)
        out[y], prev = cur, cur
    return out.reshape(h, w, bpp)[:, :, :3]


class _Figures(html.parser.HTMLParser):
    """Text of elements with an id, and the embedded report data."""

    def __init__(self) -> None:
        super().__init__()
        self.text: dict[str, str] = {}
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._open = dict(attrs).get("id")

    def handle_data(self, data: str) -> None:
        if self._open:
            self.text[self._open] = self.text.get(self._open, "") + data

    def handle_endtag(self, tag: str) -> None:
        self._open = None


@pytest.mark.skipif(find_chromium() is None, reason="no headless Chromium (apt-get install chromium); "
                    ".ci/run installs it where it can")
def test_report_renders_in_headless_chromium(raised_run, tmp_path: Path) -> None:
    # the session's 12-step run with one failure (rank 1 raised at step 5) and a checkpoint every 4 steps
    run = raised_run
    assert run.result.ok and run.summary["failures"] == 1, run.summary
    written = write_report(run.dir)
    assert set(written) == {"html", "png"}
    # The page as Chromium parsed it (DOM after load), and the screenshot it took.
    dom = subprocess.run([find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          f"--user-data-dir={tmp_path / 'profile'}", written["html"].resolve().as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    parsed = _Figures()
    parsed.feed(dom)
    data = json.loads(parsed.text["report-data"])
    summary = json.loads((run.dir / "summary.json").read_text())
    assert data["summary"] == summary
    assert parsed.text["fig-final-step"] == str(summary["final_step"]) == "12"
    assert parsed.text["fig-failures"] == str(summary["failures"])
    assert parsed.text["fig-goodput"] == f"{100 * summary['goodput']['fraction']:.1f}%"
    assert parsed.text["state"] == "finished"
    assert len(data["loss"]) == len(run.of("step"))
    assert sum(len(lane["failures"]) for lane in data["lanes"]) == summary["failures"]
    assert [c["step"] for c in data["checkpoints"] if c["status"] == "committed"] == summary["checkpoints_committed"]
    assert data["goodput"] == {k: pytest.approx(summary["goodput"][k]) for k in data["goodput"]}

    img = _read_png(written["png"])
    assert img.shape[0] > 600 and img.shape[1] >= 1200
    ink = (img.sum(axis=2) < 3 * 235).mean()
    assert ink > 0.03, f"screenshot nearly blank: {ink:.3%} non-white pixels"
    colors = {"loss": (0x1C, 0x7E, 0xD6), "failure": (0xE0, 0x31, 0x31), "productive": (0x2F, 0x9E, 0x44)}
    for name, rgb in colors.items():
        n = int((np.abs(img - np.array(rgb)).sum(axis=2) < 12).sum())
        assert n > 20, f"no {name} pixels in the screenshot"


def test_expert_load_sums_the_token_counts_and_the_page_tables_them() -> None:
    ev = _events()
    for e, counts in zip([e for e in ev if e["event"] == "step"], ([4, 4, 4, 4], [10, 2, 2, 2], [4, 4, 4, 4], [1, 1, 1, 1])):
        e["tokens_per_expert"] = {"blocks.0.moe": counts}
    view = build_view(ev, {"wall_s": 20.0})
    load = view["experts"]["blocks.0.moe"]
    assert load["total"] == [19, 11, 11, 11] and load["share"] == [0.3654, 0.2115, 0.2115, 0.2115]
    assert (load["worst"], load["worst_step"]) == (2.5, 2)  # 10 of 16 slots: 2.5x the mean of 4
    page = render_html(view)
    assert "id='experts-blocks.0.moe'" in page and "19</td><td>36.5%" in page
    assert "Load per expert" not in render_html(build_view(_events(), {"wall_s": 20.0}))  # dense: no table
