"""Pure decisions of the controller. Each takes what was observed (and the clock) and returns a decision
with a human-readable reason that also goes into the event log. No Ray, no I/O: unit-testable."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastictrain.config import RecoveryConfig, TimeoutsConfig
from elastictrain.parallel.plan import CPU_DEFAULT_SHARD_SIZE, PlanSpec, valid_world_sizes


@dataclass(frozen=True)
class Membership:
    """The verdict on who trains next: ``action`` is ``go``, ``wait`` or ``fail``."""

    action: str
    world_size: int
    reason: str


def hang_bound(step_times: Sequence[float], t: TimeoutsConfig) -> float:
    """Seconds without progress after which a rank counts as hung: ``watchdog_factor`` x the median recent
    step time, within [watchdog_floor_s, step_watchdog_cap_s]. Before any step: the cap."""
    if not step_times:
        return t.step_watchdog_cap_s
    bound = t.watchdog_factor * statistics.median(step_times[-32:])
    return min(t.step_watchdog_cap_s, max(t.watchdog_floor_s, bound))


def decide_membership(
    *, available: int, current: int, mode: str, min_workers: int, max_workers: int, global_batch: int,
    micro_batch: int, waiting_since: float | None, now: float, wait_limit_s: float, plan: str = "ddp",
    shard_size: int = CPU_DEFAULT_SHARD_SIZE,
) -> Membership:
    """How many workers form the next generation, given ``available`` ready workers (survivors plus
    ready joiners). Elastic: the largest world size valid for the plan (see parallel/plan.py; hsdp needs
    whole shard groups, so a broken group re-plans to fewer, whole groups); strict: exactly ``current``."""
    spec = PlanSpec(plan, global_batch, micro_batch, shard_size)
    valid = [w for w in valid_world_sizes(spec, max_workers) if w >= min_workers]
    waited = 0.0 if waiting_since is None else now - waiting_since
    if mode == "strict":
        if available >= current:
            return Membership("go", current, f"strict mode: {current} workers ready, world size kept")
        target, need = current, current
    else:
        fits = [w for w in valid if w <= available]
        if fits:
            w = max(fits)
            return Membership("go", w, f"{available} workers available; largest valid world size is {w}")
        target, need = (min(valid) if valid else min_workers), (min(valid) if valid else min_workers)
    if waited >= wait_limit_s:
        return Membership(
            "fail", target,
            f"only {available} of the {need} workers needed were available for {waited:.0f}s "
            f"(recovery.min_workers_wait_s={wait_limit_s:g}); add capacity or lower workers.min",
        )
    return Membership("wait", target, f"waiting for workers: {available} available, {need} needed")


def failure_verdict(
    total_failures: int, failures_by_slot: Mapping[int, int], cfg: RecoveryConfig
) -> str | None:
    """A reason to stop the run (crash loop, failure budget spent), or None to keep recovering."""
    if total_failures > cfg.max_failures:
        return (f"{total_failures} failures exceed recovery.max_failures={cfg.max_failures}; "
                "fix the cause (see the failure events) or raise the limit")
    for slot, n in sorted(failures_by_slot.items()):
        if n > cfg.max_failures_per_rank:
            return (f"worker slot {slot} failed {n} times (recovery.max_failures_per_rank="
                    f"{cfg.max_failures_per_rank}): a crash loop; see its failure events for the error")
    return None


def find_stragglers(compute_times: Mapping[int, Sequence[float]], factor: float, window: int) -> dict[int, str]:
    """Ranks whose median compute time over the last ``window`` steps exceeds ``factor`` x the median of
    the others. Returns {rank: reason}."""
    medians = {r: statistics.median(ts[-window:]) for r, ts in compute_times.items() if len(ts) >= window}
    if len(medians) < 2:
        return {}
    out = {}
    for rank, med in medians.items():
        others = [m for r, m in medians.items() if r != rank]
        base = statistics.median(others)
        if base > 0 and med > factor * base:
            out[rank] = (f"rank {rank} computes a step in {med * 1000:.1f} ms, {med / base:.1f}x its peers' "
                         f"{base * 1000:.1f} ms (recovery.straggler_factor={factor:g})")
    return out


def pick_source(steps: Mapping[int, int]) -> int:
    """The rank whose state the others take: the most advanced survivor, lowest rank on ties."""
    if not steps:
        raise ValueError("no rank holds training state")
    best = max(steps.values())
    return min(r for r, s in steps.items() if s == best)
