"""The planner's answer in words: a ranked table, one paragraph on why the winner won, and the refusal of
a layout that does not fit. Pure (strings from estimates)."""

from __future__ import annotations

from elastictrain.planner.inputs import GIB, Cluster
from elastictrain.planner.search import Estimate


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n < 100 * GIB else f"{n / GIB:.0f} GiB"


def seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


_AXES = ("dp_replicate", "dp_shard", "tp", "cp", "ep", "pp")  # the table's axis columns, in its order


def table(estimates: list[Estimate], cluster: Cluster, limit: int = 10) -> str:
    """The first ``limit`` estimates as an aligned text table (rank, layout and its axes, memory, time split,
    fits)."""
    head = ("#", "layout", "dp_rep", "dp_shard", "tp", "cp", "ep", "pp", "memory/dev", "step", "compute", "comm",
            "bubble", "fits")
    rows = [head]
    for i, e in enumerate(estimates[:limit], 1):
        c, t = e.candidate, e.time
        fits = "yes" if e.fits else f"no (-{gib(e.memory.shortfall)})"
        rows.append((str(i), c.describe(), *(str(getattr(c, a)) for a in _AXES),
                     gib(e.memory.total), seconds(t.total_s), seconds(t.compute_s), seconds(t.comm_s),
                     f"{t.bubble:.0%}", fits + ("" if e.runnable else " (not runnable yet)")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def _costs(e: Estimate) -> dict[str, float]:
    t = e.time
    host = t.dispatch_exposed_s + t.fsdp_host_exposed_s
    stretched = (t.compute_s + t.tp_s + t.ep_s + t.cp_s + host) / (1 - t.bubble)
    return {"compute": t.compute_s, "the pipeline bubble": stretched - t.compute_s - t.tp_s - t.ep_s - t.cp_s - host,
            "tensor-parallel traffic": t.tp_s / (1 - t.bubble), "pipeline sends": t.pp_s,
            "expert-parallel all-to-all": t.ep_s / (1 - t.bubble),
            "context-parallel K/V traffic": t.cp_s / (1 - t.bubble),
            "DTensor's dispatch of sharded ops": t.dispatch_exposed_s / (1 - t.bubble),
            "FSDP's per-parameter host work": t.fsdp_host_exposed_s / (1 - t.bubble),
            "exposed data-parallel traffic": t.dp_exposed_s, "the optimizer step": t.optimizer_s,
            "collective calls": t.calls_s, "ranks sharing cores": max(0.0, t.busy_s - t.path_s)}


def _mesh(e: Estimate) -> tuple[int, int, int, int, int, int]:
    c = e.candidate
    return c.dp_replicate, c.dp_shard, c.tp, c.cp, c.ep, c.pp


def why(estimates: list[Estimate], cluster: Cluster) -> str:
    """One paragraph: what won, its memory against the device, its time split, and what the runner-up loses
    by (the cost that differs most); or, when nothing fits, the closest miss and its shortfall."""
    if not estimates:
        return "no layout is valid at this world size (see the rules above)."
    best = estimates[0]
    fitting = [e for e in estimates if e.fits]
    if not best.fits:
        return refusal(best, cluster) + f" None of the {len(estimates)} candidates fits; this is the closest."
    t = best.time
    text = (f"{best.candidate.describe()} wins: predicted {seconds(t.total_s)} per step (compute "
            f"{seconds(t.compute_s)}, bubble {t.bubble:.0%}, communication {seconds(t.comm_s)} of which "
            f"{seconds(t.exposed_comm_s)} not hidden) at "
            f"{gib(best.memory.total)} of {gib(cluster.device_memory)} per device; "
            f"{len(fitting)} of {len(estimates)} candidates fit.")
    runner = next((e for e in fitting[1:] if _mesh(e) != _mesh(best)), None) or next(iter(fitting[1:]), None)
    if runner is not None:
        a, b = _costs(best), _costs(runner)
        worst = max(b, key=lambda k: b[k] - a[k])
        slower = runner.time.total_s / t.total_s - 1 if t.total_s else 0.0
        if slower < 0.005:
            text += (f" The runner-up, {runner.candidate.describe()}, is predicted as fast; the winner moves "
                     f"less data ({seconds(t.comm_s)} of communication against {seconds(runner.time.comm_s)}) "
                     "or holds less memory.")
        else:
            text += (f" The runner-up, {runner.candidate.describe()}, is {slower:.0%} slower, mostly in {worst} "
                     f"({seconds(b[worst])} against {seconds(a[worst])}).")
    misses = [e for e in estimates if not e.fits]
    if misses:
        text += f" {len(misses)} do not fit (the nearest misses by {gib(min(e.memory.shortfall for e in misses))})."
    return text


def refusal(e: Estimate, cluster: Cluster) -> str:
    """Why a layout is refused: its memory against the device, the shortfall, and the largest part."""
    m = e.memory
    parts = {k: getattr(m, k) for k in ("params", "grads", "optimizer", "gathered", "activations")}
    big = max(parts, key=parts.get)
    return (f"{e.candidate.describe()} does not fit: {gib(m.total)} per device against {gib(cluster.device_memory)}"
            f", short by {gib(m.shortfall)} ({m.shortfall:.0f} bytes); the largest part is {big} "
            f"({gib(parts[big])}): shard more (fsdp), add tp/pp, checkpoint activations or lower micro_batch.")
