"""Pure decisions of the controller. Each takes what was observed (and the clock) and returns a decision
with a human-readable reason that also goes into the event log. No Ray, no I/O: unit-testable."""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from elastictrain.config import RecoveryConfig, TimeoutsConfig
from elastictrain.controller.kinds import Charge, FailureKind
from elastictrain.parallel.layout import CPU_DEFAULT_SHARD_SIZE, LayoutSpec, is_valid, valid_world_sizes


@dataclass(frozen=True)
class Membership:
    """The verdict on who trains next: ``action`` is ``go``, ``wait`` or ``fail``."""

    action: str
    world_size: int
    reason: str


def save_membership(*, available: int, spec: LayoutSpec) -> Membership:
    """Preempted while recovering (or waiting for workers): how many of the ``available`` workers (survivors
    plus ready joiners) form a generation that only saves what they hold. Any world size the plan can run
    at serves -- a checkpoint reshards on load -- so neither ``recovery.mode`` nor ``workers.min`` applies:
    the largest valid one that fits. ``go`` or ``fail`` (no valid world size)."""
    fits = valid_world_sizes(spec, available) if available > 0 else []
    if not fits:
        return Membership("fail", 0, f"{available} worker(s) available: no world size the plan "
                                     f"{spec.plan!r} can run at, nothing to save with")
    return Membership("go", fits[-1], f"preempted while recovering: {fits[-1]} of {available} available "
                                      "worker(s) regroup to save what they hold (a checkpoint reshards on load)")


STALL_FALLBACK_FACTOR = 3
"""A stall that blames nobody (every member answers, none computes: e.g. NCCL ranks in a device sync whose
peer's kernel hangs) for this many hang bounds aborts every member and regroups them (controller/monitor.py
``_abort_stall``). Three: the hang rule has had two more bounds to name a culprit."""


def hang_bound(step_times: Sequence[float], t: TimeoutsConfig) -> float:
    """Seconds without progress after which a rank counts as hung: ``watchdog_factor`` x the median recent
    step time, within [watchdog_floor_s, step_watchdog_cap_s]. Before any step: the cap."""
    if not step_times:
        return t.step_watchdog_cap_s
    bound = t.watchdog_factor * statistics.median(step_times[-32:])
    return min(t.step_watchdog_cap_s, max(t.watchdog_floor_s, bound))


def suspect_after(step_times: Sequence[float], t: TimeoutsConfig, poll_interval_s: float) -> float:
    """Seconds without progress after which the controller polls every member (for hang blame) instead of
    the generation's reporting rank and a few others in turn: a quarter of the hang bound, and never under
    two poll intervals (progress is known one interval late: a healthy step is never suspected). A hang is
    then found at most this long after the bound alone would find it."""
    return max(hang_bound(step_times, t) / 4, 2 * poll_interval_s)


def decide_membership(
    *, available: int, current: int, mode: str, min_workers: int, max_workers: int, global_batch: int,
    micro_batch: int, waiting_since: float | None, now: float, wait_limit_s: float, plan: str = "ddp",
    shard_size: int = CPU_DEFAULT_SHARD_SIZE, spec: LayoutSpec | None = None,
    valid: Callable[[int], bool] | None = None,
) -> Membership:
    """How many workers form the next generation, given ``available`` ready workers (survivors plus
    ready joiners). Elastic: the largest world size valid for the plan (see parallel/layout.py; hsdp needs
    whole shard groups, so a broken group re-plans to fewer, whole groups; pp whole pipelines); strict:
    exactly ``current``. ``spec`` (the job's whole plan, pp included) replaces plan/shard_size when given.
    ``valid`` (``parallel.plan: auto``: some layout of the job runs and fits at that size, planner/live.py)
    replaces the plan's own rule."""
    spec = spec or LayoutSpec(plan, global_batch, micro_batch, shard_size)
    ok = valid or (lambda w: is_valid(spec, w)[0])
    waited = 0.0 if waiting_since is None else now - waiting_since
    if mode == "strict":
        if available >= current:
            return Membership("go", current, f"strict mode: {current} workers ready, world size kept")
        target, need = current, current
    else:
        # the largest valid size that fits, searched downwards from what is there: a step per size
        # skipped, not a check of every size up to workers.max (10,000 layouts resolved per decision)
        w = next((w for w in range(min(available, max_workers), min_workers - 1, -1) if ok(w)), None)
        if w is not None:
            return Membership("go", w, f"{available} workers available; largest valid world size is {w}")
        sizes = [w for w in (range(1, max_workers + 1) if valid else valid_world_sizes(spec, max_workers))
                 if w >= min_workers and ok(w)]
        target, need = (min(sizes) if sizes else min_workers), (min(sizes) if sizes else min_workers)
    if waited >= wait_limit_s:
        # strict mode needs the whole world size back: workers.min plays no part there, so the fix named
        # is capacity or elastic mode (which shrinks to what is there)
        fix = ("recovery.mode=strict keeps the world size: add capacity or set recovery.mode=elastic"
               if mode == "strict" else "add capacity or lower workers.min")
        return Membership(
            "fail", target,
            f"only {available} of the {need} workers needed were available for {waited:.0f}s "
            f"(recovery.min_workers_wait_s={wait_limit_s:g}); {fix}",
        )
    return Membership("wait", target, f"waiting for workers: {available} available, {need} needed")


@dataclass(frozen=True)
class FailureRecord:
    """One failure as the budget sees it. ``slot`` None: the group as a whole (it left its step loop and
    nobody was found dead). ``progress`` is how many steps the failed worker (or the group) completed since
    it joined; 0 for a failure in set-up or at the rendezvous."""

    at: float
    slot: int | None
    kind: FailureKind  # how it is charged: FailureKind.charge (controller/kinds.py)
    reason: str
    progress: int
    node: str | None = None  # the lost node, for ``node_lost`` (one failure of the node: budget_records)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FailureKind(self.kind))  # an unknown kind raises here, not later


def budget_records(new: Sequence[FailureRecord], log: Sequence[FailureRecord]) -> list[FailureRecord]:
    """The failures the budget counts among ``new`` (given the ``log`` counted so far): a lost node is ONE
    failure, however many workers it hosted and however many recoveries found them -- the first ``node_lost``
    record of a node (Ray never reuses a node id) stands for all, with the most progress any of them made;
    every other failure counts as it is. Without this one 8-GPU node lost twice in an hour was 16 failures
    and ended a run under the default budget."""
    charged = {r.node for r in log if r.kind.charge is Charge.NODE and r.node}
    lost: dict[str, list[FailureRecord]] = {}
    out: list[FailureRecord] = []
    for r in new:
        if r.kind.charge is not Charge.NODE or not r.node:
            out.append(r)
        elif r.node not in charged:
            if r.node not in lost:
                out.append(r)  # its place in the order; replaced by the node's record below
            lost.setdefault(r.node, []).append(r)
    merged = {rs[0].node: FailureRecord(
        rs[0].at, rs[0].slot, rs[0].kind,
        rs[0].reason if len(rs) == 1 else f"node {rs[0].node} lost with {len(rs)} workers (slots "
        f"{sorted(x.slot for x in rs if x.slot is not None)}): {rs[0].reason}",
        max(x.progress for x in rs), rs[0].node) for rs in lost.values()}
    return [merged[r.node] if r.kind.charge is Charge.NODE and r.node in merged else r for r in out]


def failure_verdict(records: Sequence[FailureRecord], now: float, cfg: RecoveryConfig) -> str | None:
    """A reason to stop the run, or None to keep recovering.

    Two budgets, neither a lifetime count (a long run meets ordinary failures all the time):
    * a rate: more than ``max_failures`` failures within the last ``failure_window_s`` seconds;
    * a crash loop: one slot (or the group) failed more than ``max_failures_per_rank`` times IN A ROW
      without making progress (each time fewer than ``progress_steps`` steps after joining, set-up failures
      included). A failure after progress resets that slot's count.
    """
    recent = [r for r in records if now - r.at <= cfg.failure_window_s]
    if len(recent) > cfg.max_failures:
        return (f"{len(recent)} failures within {cfg.failure_window_s:g}s exceed recovery.max_failures="
                f"{cfg.max_failures} per recovery.failure_window_s={cfg.failure_window_s:g}; last: "
                f"{recent[-1].reason}; fix the cause (see the failure events) or raise the limit")
    # each slot's current streak as a count and its last record (the controller judges every failure of a
    # recovery in turn: 200 at once when 2% of 10,000 ranks go, so this is called with a long log often)
    streak: dict[int | None, int] = {}
    last: dict[int | None, FailureRecord] = {}
    for r in records:
        if r.progress < cfg.progress_steps:
            streak[r.slot] = streak.get(r.slot, 0) + 1
            last[r.slot] = r
        else:
            streak[r.slot] = 0
    looping = [slot for slot, n in streak.items() if n > cfg.max_failures_per_rank]
    if looping:
        slot = min(looping, key=lambda s: -1 if s is None else s)
        who = "the worker group" if slot is None else f"worker slot {slot}"
        return (f"{who} failed {streak[slot]} times in a row without progress (each within "
                f"recovery.progress_steps={cfg.progress_steps} steps of joining; recovery.max_failures_per_rank="
                f"{cfg.max_failures_per_rank}): a crash loop; last error: {last[slot].reason}")
    return None


def setup_verdict(records: Sequence[FailureRecord], slots: int, any_setup_ok: bool) -> str | None:
    """Stop at once when the failure is deterministic: no worker ever finished set-up and every one of the
    ``slots`` slots failed its set-up with the same error (respawning would only repeat it)."""
    if any_setup_ok:
        return None
    setup = [r for r in records if r.kind.charge is Charge.SETUP]
    failed_slots = {r.slot for r in setup}
    reasons = {r.reason for r in setup}
    if slots and len(failed_slots) >= slots and len(reasons) == 1:
        return f"every worker ({slots}) failed during set-up with the same error: {setup[0].reason}"
    return None


def find_stragglers(compute_times: Mapping[int, Sequence[float]], factor: float, window: int) -> dict[int, str]:
    """Ranks whose median compute time over the last ``window`` steps exceeds ``factor`` x the median of
    the others. Returns {rank: reason}. O(N log N) in the ranks: the others' median is read off the sorted
    medians with the rank's own taken out (at 10,000 ranks the pairwise way took seconds)."""
    medians = {r: statistics.median(list(ts)[-window:]) for r, ts in compute_times.items() if len(ts) >= window}
    if len(medians) < 2:
        return {}
    ordered = sorted(medians.values())
    out = {}
    for rank, med in medians.items():
        base = _median_without(ordered, med)
        if base > 0 and med > factor * base:
            out[rank] = (f"rank {rank} computes a step in {med * 1000:.1f} ms, {med / base:.1f}x its peers' "
                         f"{base * 1000:.1f} ms (recovery.straggler_factor={factor:g})")
    return out


def _median_without(ordered: Sequence[float], value: float) -> float:
    """PURE. The median of sorted ``ordered`` with one occurrence of ``value`` removed (len >= 2)."""
    gone = bisect.bisect_left(ordered, value)
    m = len(ordered) - 1

    def at(j: int) -> float:  # the j-th of the list without index `gone`
        return ordered[j] if j < gone else ordered[j + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def pick_source(steps: Mapping[int, int]) -> int:
    """The rank whose state the others take: the most advanced survivor, lowest rank on ties."""
    if not steps:
        raise ValueError("no rank holds training state")
    best = max(steps.values())
    return min(r for r, s in steps.items() if s == best)
