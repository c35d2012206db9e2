"""The drawing half of the run report: HTML and inline SVG from the view that :func:`report.build_view` made.

Pure string building, no dependency. Every panel of the timeline shares one x axis (seconds since the run
started), so a failure lines up with the dip in throughput, the lane where it happened and the recovery.
"""

from __future__ import annotations

import html
import math
from typing import Any

COLORS = {
    "loss": "#1c7ed6", "eval": "#e8590c", "throughput": "#7048e8", "world": "#0ca678", "run": "#4dabf7", "setup": "#d0ebff",
    "failure": "#e03131", "replaced": "#2f9e44", "staged": "#f08c00", "committed": "#2f9e44", "ckfail": "#868e96",
    "resized": "#f08c00", "preempted": "#ae3ec9", "recovered": "#2f9e44", "resumed": "#1c7ed6",
    "run_failed": "#c92a2a", "grid": "#eef0f2", "axis": "#9aa5b1", "text": "#52606d",
}
GOODPUT = [("productive_s", "productive", "#2f9e44"), ("degraded_s", "degraded (smaller world)", "#a9e34b"),
           ("startup_s", "start-up", "#74c0fc"), ("detection_s", "detection", "#ff8787"),
           ("recovery_s", "recovery", "#e03131"), ("redone_s", "redone (lost steps)", "#fa5252"),
           ("compile_s", "compile (first step)", "#9775fa"), ("checkpoint_stall_s", "checkpoint stall", "#f59f00"),
           ("other_s", "other", "#ced4da")]
LEFT, RIGHT, PLOT_W = 120, 20, 1060
H_LOSS, H_TPUT, H_WORLD, H_LANE, H_CKPT, GAP, TOP = 150, 90, 44, 24, 36, 12, 22


def esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _fmt(v: Any, digits: int = 4) -> str:
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return "\u2014" if v is None else str(v)


def timeline_height(view: dict[str, Any]) -> int:
    lanes = max(1, len(view["lanes"]))
    return TOP + H_LOSS + H_TPUT + H_WORLD + lanes * H_LANE + H_CKPT + 5 * GAP + 34


def page_height(view: dict[str, Any]) -> int:
    """Pixels the page needs (a little more than it uses), for the screenshot's window size."""
    experts = view.get("experts") or {}
    moe = (40 + sum(21 * (len(v["total"]) + 2) for v in experts.values())) if experts else 0
    return 330 + timeline_height(view) + 40 + 21 * len(view["notable"]) + 60 + moe


def render_page(view: dict[str, Any], width: int) -> str:
    return "".join([_header(view), "<h2>Where the time went (goodput)</h2>", _goodput_bar(view),
                    "<h2>Timeline</h2>", _timeline(view), _experts(view), "<h2>Events</h2>", _table(view)])


def _experts(view: dict[str, Any]) -> str:
    """The router's load per expert of each MoE layer: slots over the run, share, and a bar against the even
    share 1/E (the dashed line). Nothing without MoE layers."""
    experts = view.get("experts") or {}
    if not experts:
        return ""
    out = ["<h2>Load per expert (token slots routed, over the run)</h2>"]
    for layer, v in experts.items():
        n = len(v["total"])
        even = 1.0 / max(1, n)
        top = max(max(v["share"]), even) or 1.0
        rows = []
        for i, (c, sh) in enumerate(zip(v["total"], v["share"])):
            w, ex = 300 * sh / top, 300 * even / top
            bar = (f"<svg width='310' height='12'><rect x='0' y='1' width='{w:.1f}' height='10' fill='{COLORS['run']}'/>"
                   f"<line x1='{ex:.1f}' x2='{ex:.1f}' y1='0' y2='12' stroke='{COLORS['text']}' stroke-dasharray='2,2'/></svg>")
            rows.append(f"<tr><td class='t'>{i}</td><td>{c}</td><td>{100 * sh:.1f}%</td><td>{bar}</td></tr>")
        out.append(f"<table class='experts' id='experts-{esc(layer)}'><tr><td class='e' colspan='4'>{esc(layer)}: "
                   f"worst step {esc(v['worst_step'])} at {_fmt(v['worst'], 3)}x the mean</td></tr>"
                   f"<tr><td class='t'>expert</td><td>slots</td><td>share</td><td>vs even 1/{n}</td></tr>"
                   + "".join(rows) + "</table>")
    return "".join(out)


def _count(v: Any) -> Any:
    """``checkpoints_committed`` is the list of committed steps: show how many, and the newest."""
    if isinstance(v, list):
        return f"{len(v)} (last {v[-1]})" if v else 0
    return v


def _header(view: dict[str, Any]) -> str:
    s = view["summary"]
    state = str(s.get("state") or "unknown")
    cls = state if state in ("finished", "failed", "preempted") else "other"
    gp = (s.get("goodput") or {}).get("fraction")
    figs = [("final-step", "final step", s.get("final_step")), ("final-loss", "final loss", s.get("final_loss")),
            *([("final-eval-loss", "final eval loss", s["final_eval_loss"])] if s.get("final_eval_loss") is not None
              else []),
            ("wall-s", "wall time (s)", s.get("wall_s")), ("failures", "failures", s.get("failures")),
            ("recoveries", "recoveries", s.get("recoveries")), ("lost-steps", "lost steps", s.get("lost_steps")),
            ("checkpoints", "checkpoints", _count(s.get("checkpoints_committed"))),
            ("goodput", "goodput", f"{100 * gp:.1f}%" if isinstance(gp, (int, float)) else None),
            ("mfu", "MFU (median)", f"{100 * mfu:.1f}%" if isinstance(mfu := s.get("mfu"), (int, float)) else None),
            ("tokens-per-s-per-device", "tokens/s/device", s.get("tokens_per_s_per_device"))]
    mem = s.get("memory") or {}  # the run's highest peak per kind and its rank (summary.json ``memory``)
    for kind, label in (("host", "peak host MiB"), ("alloc", "peak GPU alloc MiB"), ("reserved", "peak GPU reserved MiB")):
        if mem.get(f"{kind}_mib") is not None:
            figs.append((f"{kind}-peak", f"{label} (rank {mem.get(f'{kind}_rank')})", mem[f"{kind}_mib"]))
    boxes = "".join(f"<div class='fig'><span>{esc(label)}</span><b id='fig-{key}'>{esc(_fmt(v))}</b></div>"
                    for key, label, v in figs)
    error = f"<div class='sub' style='color:#c92a2a'>{esc(s.get('error'))}</div>" if s.get("error") else ""
    profiles = [f for p in s.get("profiles") or () for f in p.get("files", ())]
    if profiles:  # relative links: the report sits in the run directory beside profiles/
        links = " ".join(f"<a href='{esc(f)}' class='profile'>{esc(f.split('/')[-1])}</a>" for f in profiles)
        error += f"<div class='sub' id='profiles'>profiles (chrome://tracing, ui.perfetto.dev): {links}</div>"
    return (f"<h1>{esc(view.get('name'))}<span class='badge {cls}' id='state'>{esc(state)}</span></h1>"
            f"<div class='sub'>run id <b>{esc(view.get('run_id'))}</b> \u00b7 exit code {esc(s.get('exit_code'))}"
            f" \u00b7 {len(view['lanes'])} worker slots</div>{error}<div class='figs'>{boxes}</div>")


def _goodput_bar(view: dict[str, Any]) -> str:
    g = view["goodput"]
    total = sum(g.values()) or 1.0
    x, parts, legend = 0.0, [], []
    w = 1160
    for key, label, color in GOODPUT:
        v = g.get(key, 0.0)
        frac = v / total
        if frac > 0:
            parts.append(f"<rect x='{x:.1f}' y='0' width='{max(frac * w, 0.5):.1f}' height='26' fill='{color}'>"
                         f"<title>{esc(label)}: {v:.2f}s ({100 * frac:.1f}%)</title></rect>")
            if frac * w > 60:
                parts.append(f"<text x='{x + 6:.1f}' y='17' fill='#fff' font-size='12' font-weight='600'>"
                             f"{100 * frac:.0f}%</text>")
        x += frac * w
        legend.append(f"<span style='margin-right:14px;white-space:nowrap'><span style='display:inline-block;"
                      f"width:10px;height:10px;background:{color};margin-right:4px'></span>{esc(label)} "
                      f"<b>{v:.1f}s</b></span>")
    return (f"<svg id='goodput' width='{w}' height='26' role='img'>{''.join(parts)}</svg>"
            f"<div style='margin-top:4px;font-size:12px'>{''.join(legend)}</div>")


class _X:
    def __init__(self, duration: float) -> None:
        self.d = max(duration, 1e-6)

    def __call__(self, t: float) -> float:
        return LEFT + PLOT_W * min(max(t, 0.0), self.d) / self.d


def _panel_title(y0: float, color: str, label: str) -> str:
    return (f"<text x='4' y='{y0 + 14}' font-size='12' font-weight='600' fill='{color}'>{esc(label)}</text>")


def _line_panel(points: list[list[float]], x: _X, y0: float, h: float, color: str, label: str,
                second: tuple[list[list[float]], str, str] | None = None) -> str:
    """A line chart; ``second`` = (points, color, label): another series on the same scale (the eval loss)."""
    pts = [(t, v) for t, v in points if isinstance(v, (int, float)) and math.isfinite(v)]
    more = [(t, v) for t, v in (second[0] if second else []) if isinstance(v, (int, float)) and math.isfinite(v)]
    out = [f"<rect x='{LEFT}' y='{y0}' width='{PLOT_W}' height='{h}' fill='#fbfcfd' stroke='{COLORS['grid']}'/>",
           _panel_title(y0, color, label + (f" \u00b7 {second[2]} (dashed)" if more else ""))]
    if not pts:
        return "".join(out)
    vals = [v for _, v in pts + more]
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.08
    lo, hi = (lo - pad if lo - pad > 0 or lo < 0 else 0.0), hi + pad  # a non-negative series stays >= 0

    def y(v: float) -> float:
        return y0 + h - h * (v - lo) / (hi - lo)

    for frac in (0.0, 0.5, 1.0):
        v = lo + (hi - lo) * frac
        out.append(f"<line x1='{LEFT}' x2='{LEFT + PLOT_W}' y1='{y(v):.1f}' y2='{y(v):.1f}' "
                   f"stroke='{COLORS['grid']}'/><text x='{LEFT - 5}' y='{y(v) + 4:.1f}' text-anchor='end' "
                   f"font-size='10' fill='{COLORS['text']}'>{_fmt(v, 3)}</text>")
    path = " ".join(f"{'M' if i == 0 else 'L'}{x(t):.1f},{y(v):.1f}" for i, (t, v) in enumerate(pts))
    out.append(f"<path d='{path}' fill='none' stroke='{color}' stroke-width='2'/>")
    if len(pts) <= 200:
        out.extend(f"<circle cx='{x(t):.1f}' cy='{y(v):.1f}' r='2' fill='{color}'><title>t={t:.1f}s "
                   f"{esc(label)} {v:.4g}</title></circle>" for t, v in pts)
    if more:
        path = " ".join(f"{'M' if i == 0 else 'L'}{x(t):.1f},{y(v):.1f}" for i, (t, v) in enumerate(more))
        out.append(f"<path d='{path}' fill='none' stroke='{second[1]}' stroke-width='2' stroke-dasharray='5,3'/>")
        out.extend(f"<circle cx='{x(t):.1f}' cy='{y(v):.1f}' r='2.5' fill='{second[1]}'><title>t={t:.1f}s "
                   f"{esc(second[2])} {v:.4g}</title></circle>" for t, v in more[:200])
    return "".join(out)


def _world_panel(view: dict[str, Any], x: _X, y0: float) -> str:
    wmax = max([w["world_size"] for w in view["world"]] + [int(view.get("workers_max") or 1)])
    out = [f"<rect x='{LEFT}' y='{y0}' width='{PLOT_W}' height='{H_WORLD}' fill='#fbfcfd' "
           f"stroke='{COLORS['grid']}'/>", _panel_title(y0, COLORS["world"], "world size")]
    ws = view["world"]
    for i, w in enumerate(ws):
        t1 = ws[i + 1]["t"] if i + 1 < len(ws) else view["duration_s"]
        hh = (H_WORLD - 6) * w["world_size"] / wmax
        out.append(f"<rect x='{x(w['t']):.1f}' y='{y0 + H_WORLD - hh:.1f}' width='{max(0.5, x(t1) - x(w['t'])):.1f}' "
                   f"height='{hh:.1f}' fill='{COLORS['world']}' opacity='0.55'><title>world size {w['world_size']} "
                   f"from t={w['t']:.1f}s</title></rect><text x='{x(w['t']) + 3:.1f}' y='{y0 + H_WORLD - 4}' "
                   f"font-size='11' fill='#0b5345'>{w['world_size']}</text>")
    return "".join(out)


def _lanes(view: dict[str, Any], x: _X, y0: float) -> str:
    out = []
    for i, lane in enumerate(view["lanes"]):
        y = y0 + i * H_LANE
        mid = y + H_LANE / 2
        out.append(f"<text x='4' y='{mid + 4:.1f}' font-size='12' "
                   f"fill='{COLORS['text']}'>worker slot {lane['slot']}</text><line x1='{LEFT}' x2='{LEFT + PLOT_W}' "
                   f"y1='{mid:.1f}' y2='{mid:.1f}' stroke='{COLORS['grid']}'/>")
        for seg in lane["segments"]:
            xs, xr, xe = x(seg["start"]), x(seg["ready"]), x(seg["end"])
            out.append(f"<rect x='{xs:.1f}' y='{y + 5}' width='{max(0.5, xr - xs):.1f}' height='{H_LANE - 10}' "
                       f"fill='{COLORS['setup']}'><title>starting (pid {esc(seg['pid'])})</title></rect>"
                       f"<rect x='{xr:.1f}' y='{y + 5}' width='{max(0.5, xe - xr):.1f}' height='{H_LANE - 10}' "
                       f"rx='3' fill='{COLORS['run']}'><title>rank {esc(seg['rank'])} pid {esc(seg['pid'])} node "
                       f"{esc(seg['node'])}: t={seg['ready']:.1f}s..{seg['end']:.1f}s</title></rect>")
        for r in lane["replacements"]:
            xr = x(r["t"])
            out.append(f"<path d='M{xr:.1f},{y + 3} l7,{H_LANE / 2 - 3:.1f} l-7,{H_LANE / 2 - 3:.1f} z' "
                       f"fill='{COLORS['replaced']}'><title>replacement started t={r['t']:.1f}s "
                       f"(pid {esc(r['pid'])})</title></path>")
        for f in lane["failures"]:
            xf = x(f["t"])
            out.append(f"<g stroke='{COLORS['failure']}' stroke-width='3'><line x1='{xf - 6:.1f}' y1='{mid - 6:.1f}' "
                       f"x2='{xf + 6:.1f}' y2='{mid + 6:.1f}'/><line x1='{xf - 6:.1f}' y1='{mid + 6:.1f}' "
                       f"x2='{xf + 6:.1f}' y2='{mid - 6:.1f}'/><title>{esc(f['kind'])} rank {esc(f['rank'])} at step "
                       f"{esc(f['step'])}, t={f['t']:.1f}s: {esc(f['reason'])}</title></g>"
                       f"<text {_beside(xf, 9)} y='{mid - 3:.1f}' font-size='11' font-weight='600' "
                       f"fill='{COLORS['failure']}'>{esc(f['kind'])}</text>")
    return "".join(out)


def _beside(x: float, gap: float) -> str:
    """Position attributes of a label next to a mark at ``x``: to its right, or to its left (end-anchored)
    in the right quarter of the plot, so a label never runs past the page's right edge."""
    if x > LEFT + 0.75 * PLOT_W:
        return f"x='{x - gap:.1f}' text-anchor='end'"
    return f"x='{x + gap:.1f}'"


def _diamond(cx: float, cy: float, fill: str, stroke: str, title: str) -> str:
    return (f"<path d='M{cx:.1f},{cy - 6:.1f} l6,6 l-6,6 l-6,-6 z' fill='{fill}' stroke='{stroke}' "
            f"stroke-width='2'><title>{esc(title)}</title></path>")


def _checkpoints(view: dict[str, Any], x: _X, y0: float) -> str:
    mid = y0 + H_CKPT / 2
    out = [f"<text x='4' y='{mid + 4:.1f}' font-size='12' font-weight='600' "
           f"fill='{COLORS['committed']}'>checkpoints</text><line x1='{LEFT}' x2='{LEFT + PLOT_W}' y1='{mid:.1f}' "
           f"y2='{mid:.1f}' stroke='{COLORS['grid']}'/>"]
    last_label = -1e9
    for c in view["checkpoints"]:
        if c["status"] == "committed":
            xc = x(c["committed"])
            if c["staged"] is not None:
                xs = x(c["staged"])
                out.append(f"<line x1='{xs:.1f}' x2='{xc:.1f}' y1='{mid:.1f}' y2='{mid:.1f}' "
                           f"stroke='{COLORS['committed']}' stroke-width='2'/>")
                out.append(_diamond(xs, mid, "#fff", COLORS["staged"], f"step {c['step']} staged t={c['staged']:.1f}s"
                                    f" (stall {c.get('stall_s')}s)"))
            out.append(_diamond(xc, mid, COLORS["committed"], COLORS["committed"],
                                f"step {c['step']} committed t={c['committed']:.1f}s, {c.get('bytes')} bytes, "
                                f"write {c.get('write_s')}s"))
            if xc - last_label > 40:  # labels never overlap; the tooltip has every step
                out.append(f"<text x='{xc:.1f}' y='{mid - 9:.1f}' text-anchor='middle' font-size='10' "
                           f"fill='{COLORS['text']}'>step {c['step']}</text>" if xc - last_label > 60 else
                           f"<text x='{xc:.1f}' y='{mid - 9:.1f}' text-anchor='middle' font-size='10' "
                           f"fill='{COLORS['text']}'>{c['step']}</text>")
                last_label = xc
        else:
            xc = x(c["t"])
            out.append(_diamond(xc, mid, COLORS["ckfail"], COLORS["ckfail"],
                                f"step {c['step']} {c['status']}: {c.get('reason')}"))
    return "".join(out)


def _markers(view: dict[str, Any], x: _X, y_top: float, y_bottom: float) -> str:
    out = []
    last_label_x = -1e9
    for m in view["markers"]:
        xm = x(m["t"])
        color = COLORS.get(m["kind"], COLORS["failure"])
        dash = "2,3" if m["kind"] in ("recovered", "resumed") else "5,4"
        out.append(f"<line x1='{xm:.1f}' x2='{xm:.1f}' y1='{y_top}' y2='{y_bottom}' stroke='{color}' "
                   f"stroke-dasharray='{dash}' stroke-width='1.5'><title>{esc(m['label'])} t={m['t']:.1f}s"
                   f"</title></line>")
        if xm - last_label_x > 120 and m["kind"] != "recovered":
            out.append(f"<text {_beside(xm, 3)} y='{y_top - 6}' font-size='11' font-weight='600' "
                       f"fill='{color}'>{esc(m['label'])}</text>")
            last_label_x = xm
    return "".join(out)


def _axis(view: dict[str, Any], x: _X, y: float) -> str:
    d = view["duration_s"] or 1.0
    step = 10 ** math.floor(math.log10(d / 5)) if d > 0 else 1
    for mult in (1, 2, 5, 10):
        if d / (step * mult) <= 10:
            step *= mult
            break
    out = [f"<line x1='{LEFT}' x2='{LEFT + PLOT_W}' y1='{y}' y2='{y}' stroke='{COLORS['axis']}'/>"]
    t = 0.0
    while t <= d + 1e-9:
        out.append(f"<line x1='{x(t):.1f}' x2='{x(t):.1f}' y1='{y}' y2='{y + 5}' stroke='{COLORS['axis']}'/>"
                   f"<text x='{x(t):.1f}' y='{y + 17}' text-anchor='middle' font-size='11' "
                   f"fill='{COLORS['text']}'>{t:g}s</text>")
        t += step
    return "".join(out)


def _timeline(view: dict[str, Any]) -> str:
    x = _X(view["duration_s"])
    y = TOP
    parts = []
    loss_y, y = y, y + H_LOSS + GAP
    parts.append(_line_panel(view["loss"], x, loss_y, H_LOSS, COLORS["loss"], "loss",
                             (view.get("eval_loss") or [], COLORS["eval"], "eval loss")))
    parts.append(_line_panel(view["throughput"], x, y, H_TPUT, COLORS["throughput"], "samples/s"))
    y += H_TPUT + GAP
    parts.append(_world_panel(view, x, y))
    y += H_WORLD + GAP
    parts.append(_lanes(view, x, y))
    y += max(1, len(view["lanes"])) * H_LANE + GAP
    parts.append(_checkpoints(view, x, y))
    y += H_CKPT + GAP
    parts.append(_markers(view, x, TOP, y - GAP))
    parts.append(_axis(view, x, y))
    height = timeline_height(view)
    legend = ("<div style='font-size:12px;color:#52606d;margin-top:2px'>lanes: <b style='color:#4dabf7'>\u25ac</b> "
              "running, <b style='color:#a5d8ff'>\u25ac</b> starting, <b style='color:#e03131'>\u2716</b> failure, "
              "<b style='color:#2f9e44'>\u25b6</b> replacement \u00b7 checkpoints: <b style='color:#f08c00'>\u25c7</b> "
              "staged \u2192 <b style='color:#2f9e44'>\u25c6</b> committed, <b style='color:#868e96'>\u25c6</b> "
              "failed/skipped \u00b7 dashed lines: failures (red), resizes (orange), preemption (purple)</div>")
    return f"<svg id='timeline' width='{LEFT + PLOT_W + RIGHT}' height='{height}' role='img'>{''.join(parts)}</svg>" + legend


def _table(view: dict[str, Any]) -> str:
    rows = "".join(f"<tr><td class='t'>{r['t']:.1f}s</td><td class='e'>{esc(r['event'])}</td>"
                   f"<td>{esc(r['text'])}</td></tr>" for r in view["notable"])
    return f"<table id='events'>{rows}</table>"
