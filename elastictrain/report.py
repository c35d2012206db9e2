"""``elastictrain report RUN_DIR``: one self-contained HTML page (inline CSS and SVG, no script from the
network, no external file) and a PNG of it, from ``events.jsonl`` and ``summary.json``.

The page shows, on one shared time axis: loss and throughput (each step once: a redone step's ``step``
event supersedes its first attempt's), the world size, a lane per worker slot (running,
starting, failures with their kind, replacements), checkpoints (staged when their step completed, committed
when the manifest was written), failure/resize/preemption markers; above it the figures of ``summary.json``
and the goodput breakdown as one bar; for a mixture-of-experts model, a table of the router's load per
expert of each MoE layer (:func:`expert_load`, from the step events' ``tokens_per_expert``). The page's data (what it drew, and the summary it read) is embedded as
JSON in ``<script id="report-data" type="application/json">`` so tools and tests can check it.

The PNG is a screenshot of the page by a headless Chromium when one is installed (``chromium``,
``chromium-browser`` or ``google-chrome``); without one only the HTML is written, and the command says so.
"""

from __future__ import annotations

import html
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from elastictrain.events import GOODPUT_BUCKETS, read_events
from elastictrain.report_svg import render_page

BUCKETS = (*GOODPUT_BUCKETS, "other_s")
PAGE_WIDTH = 1240


def build_view(events: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """Everything the page draws, as plain data (times in seconds since ``run_started``). Pure."""
    start = next((e for e in events if e["event"] == "run_started"), events[0] if events else {"time": 0.0})
    t0 = float(start["time"])
    end = max([float(e["time"]) for e in events] + [t0 + float(summary.get("wall_s") or 0.0)])

    def t(e: dict[str, Any]) -> float:
        return round(float(e["time"]) - t0, 3)

    progress = [e for e in events if e["event"] == "step"]
    # each step once: a redone step's event (after a restore from an older step) supersedes the earlier one
    newest = {int(e["step"]): i for i, e in enumerate(progress)}
    steps = [e for i, e in enumerate(progress) if newest[int(e["step"])] == i]

    def done(e: dict[str, Any]) -> float:  # when the step completed (worker clock); the driver records in batches
        return round(float(e.get("finished_at") or e["time"]) - t0, 3)

    step_time = {int(e["step"]): done(e) for e in steps}
    lanes: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["event"] == "worker_started":
            slot = int(e.get("slot", e.get("rank", 0)) or 0)
            lane = lanes.setdefault(slot, {"slot": slot, "segments": [], "failures": [], "replacements": []})
            began = max(0.0, t(e) - float(e.get("setup_s") or 0.0))
            if lane["segments"]:
                lane["replacements"].append({"t": began, "rank": e.get("rank"), "pid": e.get("pid")})
                lane["segments"][-1]["end"] = min(lane["segments"][-1]["end"] or t(e), t(e))
            lane["segments"].append({"start": began, "ready": t(e), "end": None, "pid": e.get("pid"),
                                     "rank": e.get("rank"), "node": str(e.get("node_id") or "")[:8]})
        elif e["event"] == "failure" and e.get("slot") is not None:
            slot = int(e["slot"])
            lane = lanes.setdefault(slot, {"slot": slot, "segments": [], "failures": [], "replacements": []})
            lane["failures"].append({"t": t(e), "kind": e.get("kind"), "rank": e.get("rank"),
                                     "step": e.get("step"), "reason": str(e.get("reason") or "")[:200]})
            if lane["segments"] and lane["segments"][-1]["end"] is None:
                lane["segments"][-1]["end"] = t(e)
    for lane in lanes.values():
        for seg in lane["segments"]:
            if seg["end"] is None:
                seg["end"] = round(end - t0, 3)
    checkpoints = []
    for e in events:
        if e["event"] == "checkpoint_saved":
            s = int(e["step"])
            checkpoints.append({"step": s, "staged": step_time.get(s), "committed": t(e), "bytes": e.get("bytes"),
                                "write_s": e.get("write_s"), "stall_s": e.get("stall_s"), "status": "committed"})
        elif e["event"] in ("checkpoint_failed", "checkpoint_skipped"):
            s = e.get("step")
            checkpoints.append({"step": s, "staged": step_time.get(int(s)) if s is not None else None,
                                "committed": None, "t": t(e), "status": e["event"].split("_")[1],
                                "reason": str(e.get("reason") or "")[:200]})
    markers = [{"t": t(e), "kind": e["event"], "label": _marker_label(e)} for e in events
               if e["event"] in ("failure", "resized", "preempted", "resumed", "run_failed", "recovered")]
    world = [{"t": t(e), "world_size": e["world_size"]} for e in events if e["event"] == "generation_started"]
    goodput = summary.get("goodput") or {}
    return {
        "name": start.get("name"), "run_id": start.get("run_id"), "duration_s": round(end - t0, 3),
        "summary": summary,
        "loss": [[step_time[int(e["step"])], e["loss"]] for e in steps if e.get("loss") is not None],
        "eval_loss": [[step_time[int(e["step"])], e["eval_loss"]] for e in steps if e.get("eval_loss") is not None],
        "throughput": [[done(e), e.get("samples_per_s")] for e in steps],
        "steps": [[done(e), int(e["step"])] for e in progress],  # as it went: a restore goes back
        "world": world, "workers_max": start.get("workers_max"),
        "lanes": [lanes[k] for k in sorted(lanes)], "checkpoints": checkpoints, "markers": markers,
        "goodput": {k: float(goodput.get(k) or 0.0) for k in BUCKETS},
        "notable": [{"t": t(e), "event": e["event"], "text": _notable_text(e)} for e in events
                    if e["event"] not in ("step", "run_started", "worker_started")][:60],
        "experts": expert_load(steps),
    }


def expert_load(steps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per MoE layer, from the step events' ``tokens_per_expert``: ``total`` (token slots per expert over the
    run), ``share`` (each expert's fraction of them) and ``worst`` (the highest max/mean ratio of one step:
    1.0 is a perfect balance, E means one expert took every slot), with ``worst_step``. Empty without MoE."""
    out: dict[str, dict[str, Any]] = {}
    for e in steps:
        for layer, counts in (e.get("tokens_per_expert") or {}).items():
            acc = out.setdefault(layer, {"total": [0] * len(counts), "worst": 0.0, "worst_step": None})
            acc["total"] = [a + int(c) for a, c in zip(acc["total"], counts)]
            mean = sum(counts) / max(1, len(counts))
            ratio = max(counts) / mean if mean else 0.0
            if ratio > acc["worst"]:
                acc["worst"], acc["worst_step"] = round(ratio, 4), int(e["step"])
    for acc in out.values():
        n = sum(acc["total"])
        acc["share"] = [round(c / n, 4) if n else 0.0 for c in acc["total"]]
    return out


def _marker_label(e: dict[str, Any]) -> str:
    name = e["event"]
    if name == "failure":
        return f"{e.get('kind')} rank {e.get('rank')}"
    if name == "resized":
        return f"world {e.get('old_world_size')}\u2192{e.get('new_world_size')}"
    if name == "recovered":
        return f"recovered ({e.get('source')}, {float(e.get('downtime_s') or 0):.1f}s down)"
    if name == "resumed":
        return f"resumed at step {e.get('step')}"
    return name.replace("_", " ")


def _notable_text(e: dict[str, Any]) -> str:
    skip = {"event", "time", "reason", "sample_ids"}
    text = " ".join(f"{k}={v}" for k, v in e.items() if k not in skip and v is not None)
    return (text + (f" \u2014 {e['reason']}" if e.get("reason") else ""))[:300]


def render_html(view: dict[str, Any]) -> str:
    """The page: inline CSS and SVG; the view embedded as JSON (``</`` escaped so it cannot end the tag)."""
    data = json.dumps(view, separators=(",", ":")).replace("</", "<\\/")
    body = render_page(view, PAGE_WIDTH)
    title = html.escape(f"elastictrain report: {view.get('name')}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
            f"<style>{_CSS}</style></head><body>{body}"
            f"<script id='report-data' type='application/json'>{data}</script></body></html>\n")


_CSS = """
body{margin:0;padding:18px 20px;font:13px/1.4 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;
color:#1f2933;background:#fff;width:1200px}
h1{font-size:20px;margin:0 0 4px} .sub{color:#52606d;margin-bottom:12px}
.badge{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:600;font-size:12px;
vertical-align:middle;margin-left:8px} .finished{background:#2f9e44} .failed{background:#e03131}
.preempted{background:#f08c00} .other{background:#868e96}
.figs{display:flex;gap:10px;margin:8px 0 14px;flex-wrap:wrap}
.fig{border:1px solid #e4e7eb;border-radius:6px;padding:6px 12px;min-width:96px}
.fig b{display:block;font-size:18px} .fig span{color:#52606d;font-size:11px;text-transform:uppercase}
h2{font-size:14px;margin:14px 0 4px} svg text{font-family:inherit}
table{border-collapse:collapse;width:100%;font-size:12px} td{padding:2px 6px;border-top:1px solid #eef0f2;
vertical-align:top} td.t{color:#52606d;white-space:nowrap;width:60px;text-align:right}
td.e{white-space:nowrap;font-weight:600;width:140px}
"""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(html_path: Path, png_path: Path, width: int, height: int, timeout_s: float = 120.0) -> str | None:
    """Screenshot ``html_path`` with headless Chromium; returns None on success, else why it was not made."""
    browser = find_chromium()
    if browser is None:
        return "no headless Chromium found (apt-get install chromium)"
    with tempfile.TemporaryDirectory(prefix="etreport") as profile:
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               "--disable-extensions", f"--user-data-dir={profile}", f"--window-size={width},{height}",
               f"--screenshot={png_path}", html_path.resolve().as_uri()]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"{browser} did not finish within {timeout_s:.0f}s"
    if proc.returncode != 0 or not png_path.is_file():
        return f"{browser} exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
    return None


def write_report(run_dir: str | Path, out: str | Path | None = None, png: bool = True) -> dict[str, Path]:
    """Write the HTML (default ``RUN_DIR/report.html``) and, when ``png`` and Chromium allow, the PNG beside it.

    Returns ``{"html": path, "png": path}`` (``png`` absent when it could not be made; a line on stderr says
    why). Raises FileNotFoundError when RUN_DIR has no events.jsonl.
    """
    import sys

    run_dir = Path(run_dir)
    events = read_events(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    view = build_view(events, summary)
    html_path = Path(out) if out else run_dir / "report.html"
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(render_html(view))
    written = {"html": html_path}
    if png:
        from elastictrain.report_svg import page_height

        png_path = html_path.with_suffix(".png")
        why = screenshot(html_path, png_path, PAGE_WIDTH, page_height(view))
        if why is None:
            written["png"] = png_path
        else:
            print(f"elastictrain: report PNG not written: {why}", file=sys.stderr)
    return written


__all__ = ["build_view", "render_html", "write_report", "screenshot", "find_chromium"]
