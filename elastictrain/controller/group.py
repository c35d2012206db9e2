"""The worker group: one placement bundle and one actor per slot (``workers.max + workers.spares``). The
first ``workers.min`` slots share one placement group (with ``workers.placement_strategy``); every other
slot has its own, so the run starts with what fits and grows when capacity appears. A slot whose actor
died gets a new actor in the same bundle: Ray re-places a bundle lost with its node when capacity exists,
so a replacement waits for capacity instead of failing. A slot with a group of its own that lost its node
gets a new group instead (:meth:`WorkerGroup.replace_lost_placement`: Ray's re-placing spins its GCS).
With ``workers.reuse`` (CPU workers) a placed slot's actor is created outside its group, pinned to the
bundle's node, or taken warm from the driver's pool of earlier runs' processes (a first generation's
workers, a replacement, a grow-back alike), and a run that ended ``finished`` gives the workers that trained
through to its end back to that pool (:meth:`WorkerGroup.keep_warm`; :mod:`elastictrain.controller.warm_pool`
says why it is built so). An idle pooled process on a node stands in for the standby there.
With ``workers.standby`` the group keeps one worker process started ahead (imports done, model and data built,
no resources of its own) that the next replacement on its node runs in: the first with the first generation's
workers (:meth:`WorkerGroup.start_first_standby`), at their priority, the next each time a replacement is up,
once the generation it joined has completed a step (:meth:`WorkerGroup.start_due_standby`). Those later ones run
in ``SCHED_IDLE`` (imports, set-up ahead) until a replacement takes them (:mod:`elastictrain.worker.import_priority`;
Ray's start of the process too, lowered from outside on the driver's node:
:mod:`elastictrain.controller.standby_start`), so their start takes from training only the CPU the training
processes leave idle. A replacement the standby serves with its set-up ahead done is taken at detection and
joins the recovery generation itself (:meth:`WorkerGroup.standby_prebuilt`, the controller's ``_take_prebuilt``).

Mechanism only: who joins which generation is the controller's decision.
"""

from __future__ import annotations

import enum
import operator
import os
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from elastictrain.config import JobConfig
from elastictrain.controller.detect import CallOutcome
from elastictrain.controller.runtime import RAY, Runtime
from elastictrain.controller.standby_start import (RAY_REGISTER_TIMEOUT_ENV, RAY_REGISTER_TIMEOUT_S, StartWatch,
                                                   register_bound_s, supported)
from elastictrain.controller.warm_pool import POOL, PoolKey, Warm, node_cpus, pool_key
from elastictrain.task import Task
from elastictrain.worker.actor import worker_actor_class
from elastictrain.worker.import_priority import PRIORITIES_ENV, STANDBY_ENV, Phase, put_back, sweep


def describe_remote_error(exc: BaseException, limit: int = 500) -> str:
    """The worker's own error in one line: the exception a task raised (not Ray's wrapper and its
    traceback), or why the actor died. Capped at ``limit`` characters."""
    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None
    err = cause if isinstance(cause, BaseException) else exc
    text = " ".join(str(err).split()) or "(no message)"
    if isinstance(err, ray.exceptions.RayActorError):  # Ray's long text: keep why the actor died
        text = text[text.find("The actor is dead"):] if "The actor is dead" in text else text
        text = text.split(" Some common causes")[0]
    if isinstance(err, ray.exceptions.RayTaskError):  # no cause to unwrap: keep the last line (the error)
        text = " ".join(str(err).strip().splitlines()[-1].split())
    line = f"{type(err).__name__}: {text}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


class MemberCallFailed(RuntimeError):
    """A call made on several members failed; ``outcomes`` says how each member's part ended (see
    :func:`elastictrain.controller.detect.blame` for whose failure it is)."""

    def __init__(self, what: str, outcomes: list[CallOutcome], cause: BaseException) -> None:
        errors = "; ".join(f"slot {o.slot} {o.status}: {o.error}" for o in outcomes if o.error)
        super().__init__(f"{what} failed ({errors or describe_remote_error(cause)})")
        self.what, self.outcomes = what, outcomes


def call_outcomes(calls: list[tuple[Slot, Any]], rt: Runtime = RAY) -> list[CallOutcome]:
    """How each member's call (``(slot, ref)``) ended, without waiting (see :class:`CallOutcome`)."""
    from elastictrain.worker.errors import is_communication_error

    refs = [ref for _, ref in calls]
    done = set(rt.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
    out = []
    for slot, ref in calls:
        if ref not in done:
            out.append(CallOutcome(slot.index, "pending"))
            continue
        try:
            rt.get(ref)
        except ray.exceptions.RayActorError as e:
            out.append(CallOutcome(slot.index, "dead", describe_remote_error(e)))
        except Exception as e:  # noqa: BLE001 - classified: its own error, or a peer's broken communication
            cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else e
            # the cause crossed processes without its frames: its origin is read from Ray's traceback text
            remote_tb = getattr(e, "traceback_str", None) if isinstance(e, ray.exceptions.RayTaskError) else None
            peer = isinstance(cause, BaseException) and is_communication_error(cause, remote_tb)
            out.append(CallOutcome(slot.index, "peer" if peer else "own", describe_remote_error(e)))
        else:
            out.append(CallOutcome(slot.index, "ok"))
    return out


def call_members(calls: list[tuple[Slot, Any]], timeout: float, what: str, rt: Runtime = RAY) -> list[Any]:
    """``get`` of the members' calls ``(slot, ref)``, in order. Raises :class:`MemberCallFailed` with
    every member's outcome when any part fails or the call outlasts ``timeout``."""
    try:
        return rt.get([ref for _, ref in calls], timeout=timeout)
    except Exception as e:  # noqa: BLE001 - whose failure it is: the outcomes tell
        raise MemberCallFailed(what, call_outcomes(calls, rt), e) from e


def describe_shortfall(bundle: dict[str, float], free_by_node: list[dict[str, float]]) -> str:
    """PURE. Which resources of one worker ``bundle`` no node has free, e.g. "GPU: 0 of 1 free on any
    node"; when every resource fits on some node but not all on one, says so."""
    missing = []
    for res, need in sorted(bundle.items()):
        best = max((node.get(res, 0.0) for node in free_by_node), default=0.0)
        if best < need:
            missing.append(f"{res}: {best:g} of {need:g} free on any node")
    if missing:
        return "; ".join(missing)
    if any(all(node.get(r, 0.0) >= n for r, n in bundle.items()) for node in free_by_node):
        return f"a worker bundle {bundle} fits now (capacity appeared while waiting)"
    return f"no single node has a whole worker bundle {bundle} free"


# workers.reuse: how long the first spawn waits for the core group to be placed (the run cannot start without
# it; a worker in the bundle would wait as long), and the first spawn of an extra slot for all the extra slots'
# groups at once (created with the core: placed by then, unless capacity is short; else a worker in the bundle)
PLACEMENT_WAIT_S = 30.0
EXTRA_PLACEMENT_WAIT_S = 2.0


class SlotState(enum.Enum):
    STARTING = "starting"  # actor created, setup() in flight
    READY = "ready"        # set up, not in the current generation
    MEMBER = "member"      # in the current generation
    DEAD = "dead"          # failed or killed; a replacement may be started


@dataclass
class Slot:
    """One worker's place in the group. Its ``state`` is indexed by the group (:meth:`WorkerGroup.by_state`
    answers from the index, not by scanning every slot: at 10,000 slots the controller asks every poll
    interval whether a worker is starting or ready)."""

    index: int
    actor: Any = None
    state: SlotState = SlotState.DEAD
    setup_ref: Any = None
    info: dict[str, Any] = field(default_factory=dict)  # pid, node_id, ip from setup()
    has_state: bool = False  # holds trained state (a survivor), not a fresh joiner
    rank: int | None = None
    started_at: float = 0.0
    incarnation: int = 0
    from_standby: bool = False  # this incarnation runs in the standby process started ahead
    reusable: bool = False  # this incarnation's process is outside the placement group (workers.reuse)
    reused: bool = False  # ... and was taken warm from the pool (an earlier run's process)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state":
            index = self.__dict__.get("_by_state")
            if index is not None:
                index[self.__dict__["state"]].discard(self.index)
                index[value].add(self.index)
        object.__setattr__(self, name, value)


_rank = operator.attrgetter("rank")


class WorkerGroup:
    # A worker process started ahead (``workers.standby``): its imports are done, its model and data built,
    # and it has no slot yet; the next spawn on its node takes it instead of starting a process. Class-level defaults so
    # that a subclass with an __init__ of its own (tests' fake groups) has none.
    _standby: Any = None
    _standby_probe: Any = None  # its node id, once the process is up (an ObjectRef)
    _standby_setup: Any = None  # the ObjectRef of its set-up ahead (model, data, no slot)
    _standby_node: str | None = None  # the node of the bundle it was started in (where Ray placed it)
    _standby_started: bool = False  # one was started in this run (the first by start_first_standby)
    _standby_file: str | None = None  # where it writes its priorities before lowering them (same node only)
    _standby_due: int | None = None  # a replacement came up: the next standby starts on its node (start_due_standby)
    _standby_watch: StartWatch | None = None  # lowers Ray's start of a standby started ahead (standby_start.py)
    _marks: list[str] = []  # files of standbys taken: removed at shutdown (a mark must outlive the take)
    rt: Runtime = RAY  # how the controller waits for and takes the results of calls on this group's actors
    _reuse: bool = False  # workers.reuse (CPU workers): placed slots' processes are pooled (warm_pool.py)
    _pool_key: PoolKey | None = None
    _warm: list[Warm] = []  # this run's workers retired into the pool (keep_warm); released at shutdown
    _placement_waited: set[int] = set()  # placement groups waited for once (reusable spawns)

    def __init__(self, config: JobConfig, task: Task) -> None:
        self.config = config
        self.task = task
        w = config.workers
        self.bundle: dict[str, float] = {"CPU": w.cpus_per_worker}
        if w.use_gpu:
            self.bundle["GPU"] = 1
        slots = w.max + w.spares  # spares hold a bundle too, so a replacement never waits for capacity
        # The first `min` slots are placed together (the run needs them all; the strategy applies to them);
        # every other slot has a placement group of its own, so the run starts with what fits and grows as
        # capacity appears, instead of waiting for one all-or-nothing group of max + spares bundles.
        core = placement_group([dict(self.bundle) for _ in range(w.min)], strategy=w.placement_strategy)
        self._placement: list[tuple[Any, int]] = [(core, i) for i in range(w.min)]
        for _ in range(w.min, slots):
            self._placement.append((placement_group([dict(self.bundle)], strategy="PACK"), 0))
        self._pgs = [core] + [pg for pg, _ in self._placement[w.min:]]
        self._ready_refs = {id(pg): pg.ready() for pg in self._pgs}
        self.slots = [Slot(i) for i in range(slots)]
        self._actor_cls = worker_actor_class()
        self._reuse = w.reuse and not w.use_gpu
        self._warm, self._placement_waited = [], set()
        if self._reuse:  # reuse off: this run neither takes from the pool nor empties it (warm_pool.py)
            self._pool_key = pool_key(config, task)

    def placed(self, slot: Slot) -> bool:
        """True once the slot's placement group holds its resources (an actor there can start)."""
        pg, _ = self._placement[slot.index]
        done, _ = ray.wait([self._ready_refs[id(pg)]], timeout=0)
        return bool(done)

    def shortfall(self) -> str:
        """Why a worker bundle does not fit now, by resource (e.g. "GPU: 0 of 1 free on any node")."""
        try:
            from ray._private.state import available_resources_per_node

            free = list(available_resources_per_node().values())
        except Exception as e:  # noqa: BLE001 - an internal Ray API; the message degrades, the run does not
            return f"free resources unknown ({type(e).__name__}: {e})"
        return describe_shortfall(self.bundle, free)

    def replace_lost_placement(self, index: int) -> bool:
        """The slot's node died: give it a new placement group of its own, if it had one. Ray re-places
        the lost bundle of a group, but in Ray 2.60 a re-placing group that does not fit now (no spare
        capacity: the usual case after a node loss) is retried on every pass of the GCS scheduler
        (ray-project/ray#65007): measured here, the GCS and the dashboard agent each took a whole core and
        a replacement's set-up took 110 s instead of 2. A new group waits for capacity with the GCS's
        backoff instead. The shared group of the first ``workers.min`` slots is left to Ray: removing it
        would kill the live workers in its other bundles. Returns whether the group was replaced."""
        if index < self.config.workers.min:
            return False
        old, _ = self._placement[index]
        try:
            remove_placement_group(old)
        except Exception:  # noqa: BLE001 - already gone with the cluster: the new group stands alone
            pass
        new = placement_group([dict(self.bundle)], strategy="PACK")
        self._placement[index] = (new, 0)
        self._pgs = [new if pg is old else pg for pg in self._pgs]
        self._ready_refs.pop(id(old), None)
        self._ready_refs[id(new)] = new.ready()
        return True

    def spawn(self, index: int) -> Slot:
        """Start a (new) actor in slot ``index`` and its set-up. Non-blocking. A standby process on the
        slot's node takes the place if there is one (``slot.info['standby']`` says so once set up)."""
        slot = self.slots[index]
        w = self.config.workers
        actor = self._take_standby(index)
        slot.from_standby = actor is not None
        slot.reusable = slot.reused = False
        setup_ref = None
        if actor is None and self._reuse:
            actor, setup_ref = self._spawn_reusable(slot)
        if actor is None:
            actor = self._actor_cls.options(
                num_cpus=w.cpus_per_worker, num_gpus=1 if w.use_gpu else 0,
                scheduling_strategy=self._in_bundle(index), max_restarts=0, max_task_retries=0,
            ).remote(self.config, self.task, index)
        slot.actor = actor
        slot.setup_ref = setup_ref if setup_ref is not None else slot.actor.setup.remote(index)
        slot.state, slot.has_state, slot.rank, slot.info = SlotState.STARTING, False, None, {}
        slot.started_at = time.time()
        slot.incarnation += 1
        return slot

    def _spawn_reusable(self, slot: Slot) -> tuple[Any, Any]:
        """``(actor, setup ref)`` for a slot under ``workers.reuse``: a warm process from the pool on the node of
        the slot's bundle (its ``reuse`` call is the set-up), else a new one outside the placement group
        (``num_cpus=0``, hard affinity to that node: the bundle holds the resources) whose set-up the caller
        starts. ``(None, None)`` while the bundle is not placed: the caller starts one in the bundle (never
        pooled). The first spawn of a slot waits for its group to be placed, bounded, once per group (the
        run's first workers are spawned right after their groups are created; the extra slots' groups are
        waited for together)."""
        pg, _ = self._placement[slot.index]
        if id(pg) not in self._placement_waited:
            core = slot.index < self.config.workers.min
            pgs = [pg] if core else [p for p, _ in self._placement[self.config.workers.min:]]
            refs = [self._ready_refs[id(p)] for p in pgs if id(p) not in self._placement_waited]
            self._placement_waited.update(id(p) for p in pgs)
            ray.wait(refs, num_returns=len(refs), timeout=PLACEMENT_WAIT_S if core else EXTRA_PLACEMENT_WAIT_S)
        node = self._placed_node(slot.index) if self.placed(slot) else None
        if node is None:
            return None, None
        slot.reusable = True
        warm = POOL.take(self._pool_key, node)
        if warm is not None:
            slot.reused = True
            return warm.actor, warm.actor.reuse.remote(self.config, self.task, slot.index)
        actor = self._actor_cls.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            max_restarts=0, max_task_retries=0,
        ).remote(self.config, self.task, slot.index)
        return actor, None

    def _placed_node(self, index: int) -> str | None:
        """The node of slot ``index``'s bundle while its group stands placed (``CREATED``); None while Ray
        re-places it (a lost node: an actor pinned there would be unschedulable, one in the bundle waits)."""
        pg, bundle = self._placement[index]
        try:
            table = placement_group_table(pg)
        except Exception:  # noqa: BLE001 - unknown: a worker in the bundle, as without reuse
            return None
        return table.get("bundles_to_node_id", {}).get(bundle) if table.get("state") == "CREATED" else None

    def keep_warm(self) -> int:
        """The run ended ``finished`` (the controller's judgement; its failed workers were killed on the way):
        retire its reusable members and ready spares (``Worker.retire``) and keep those that answered
        True within ``timeouts.poll_s`` for the pool (handed over at :meth:`shutdown`); the others (a
        worker that failed a step by its own error or that a fault fired in says False) are killed by
        it as usual. Returns how many were kept. Never raises."""
        if not self._reuse:
            return 0
        try:
            return self._retire_into_pool()
        except Exception:  # noqa: BLE001 - Ray going away: nothing is kept, shutdown kills as usual
            return len(self._warm)

    def _retire_into_pool(self) -> int:
        slots = [s for s in self.slots
                 if s.actor is not None and s.reusable and s.state in (SlotState.MEMBER, SlotState.READY)]
        calls = [(s, s.actor.retire.remote()) for s in slots]
        if calls:
            ray.wait([ref for _, ref in calls], num_returns=len(calls), timeout=self.config.timeouts.poll_s)
        for s, ref in calls:
            try:
                ok = ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - not answered, or failed: killed at shutdown
                continue
            if ok is True:
                self._warm.append(Warm(s.actor, int(s.info.get("pid") or 0), str(s.info.get("ip")),
                                       str(s.info.get("node_id")), self._pool_key.session))
                # the pool's now, not this run's: shutdown's kill (by actor and by pid) must not reach it
                s.actor, s.setup_ref, s.state = None, None, SlotState.DEAD
                s.info.pop("pid", None)
        return len(self._warm)

    def _in_bundle(self, index: int) -> PlacementGroupSchedulingStrategy:
        pg, bundle = self._placement[index]
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)

    def _bundle_node(self, index: int) -> str | None:
        pg, bundle = self._placement[index]
        try:
            return placement_group_table(pg).get("bundles_to_node_id", {}).get(bundle)
        except Exception:  # noqa: BLE001 - unknown: the standby is not used
            return None

    def _start_standby(self, index: int, phase: Phase = Phase.AHEAD) -> None:
        """Start a standby process on the node of slot ``index``'s bundle, in ``phase`` (its CPU priority
        until taken: :func:`~elastictrain.worker.import_priority.priority_for`). It asks for no resources
        (the slot it will take holds them) and does nothing until :meth:`spawn` hands it a slot. CPU workers
        only: a process started without a GPU cannot take one later."""
        w = self.config.workers
        if not w.standby or w.use_gpu or self._standby is not None:
            return
        self._standby_started = True
        self._standby_node = self._bundle_node(index)
        if self._reuse and POOL.holds(self._pool_key, self._standby_node):
            self._standby_node = None  # an idle pooled process there serves the next replacement (_spawn_reusable)
            return
        folder = os.path.join(tempfile.gettempdir(), "elastictrain-standby")
        sweep(folder, time.time())  # what standbys killed before their group could remove their files left
        self._standby_file = os.path.join(folder, f"{uuid.uuid4().hex}.json")
        self._standby = self._actor_cls.options(
            num_cpus=0, scheduling_strategy=self._in_bundle(index), max_restarts=0, max_task_retries=0,
            # a process of its own; started while the run trains, it stays at the lowest CPU priority until
            # taken (worker/import_priority.py)
            runtime_env={"env_vars": {STANDBY_ENV: phase.value, PRIORITIES_ENV: self._standby_file}},
        ).remote(self.config, self.task, -1)
        if phase is Phase.AHEAD:  # Ray's start of it too, from outside (it runs at the raylet's nice until connected)
            self._standby_watch = self._watch_start()
        self._standby_probe = self._standby.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
        # and builds what a fresh worker builds (model, data) ahead, so taking it only names the slot
        # (Worker.setup; measured 0.4-0.6 s of a replacement's start on 2 busy cores, now paid before a death)
        self._standby_setup = self._standby.setup.remote(None)

    def _watch_start(self) -> StartWatch | None:
        """A :class:`~elastictrain.controller.standby_start.StartWatch` for the standby just created, where it
        starts on this process's node (its process is found among the raylet's children, whose pid is the
        parent of a member on this node); None elsewhere (nothing is lowered before its preload there)."""
        if not supported() or self._standby_file is None:
            return None
        here = ray.get_runtime_context().get_node_id()
        if self._standby_node != here:
            return None
        slots = self.by_state(SlotState.MEMBER, SlotState.READY, SlotState.STARTING)
        raylet = next((r for r in (self._raylet_of(s, here) for s in slots) if r is not None), None)
        if raylet is None:
            return None
        try:
            ray_timeout = float(os.environ.get(RAY_REGISTER_TIMEOUT_ENV, RAY_REGISTER_TIMEOUT_S))
        except ValueError:
            ray_timeout = RAY_REGISTER_TIMEOUT_S
        return StartWatch(raylet, self._standby_file, self._standby_file, register_bound_s(ray_timeout))

    @staticmethod
    def _raylet_of(slot: Slot, node: str) -> int | None:
        """The pid of the raylet that started ``slot``'s process, where that process lives on ``node`` (this
        process's)."""
        pid = slot.info.get("pid")
        if not pid or slot.info.get("node_id") != node:
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{parent}/comm") as f:
                return parent if f.read().strip() == "raylet" else None
        except (OSError, IndexError, ValueError):
            return None

    def start_first_standby(self) -> None:
        """Start the run's first standby, on the node of the lowest member slot (or, before the first
        generation, of the lowest starting one); once per run (after that each replacement that came up makes
        the next due, :meth:`start_due_standby`). The controller calls it right after it spawned the first
        generation's workers, and it starts at their priority (``Phase.START``): its start then falls in the
        run's start-up, which the cores spend importing anyway, is done in seconds and shows in the run's wall
        time, not in its steps (in the idle class it was smeared over the whole run:
        docs/perf/2026-11-28-standby-first.md); and it is up before a first failure, so the first
        replacement of a run is warm too."""
        if self._standby_started or not self.config.workers.standby:
            return
        slots = self.by_state(SlotState.MEMBER) or self.by_state(SlotState.STARTING, SlotState.READY)
        if not slots:
            return
        self._start_standby(min(s.index for s in slots), Phase.START)

    def standby_prebuilt(self, index: int) -> bool:
        """True when the standby process would serve slot ``index`` (it runs on that slot's node) and its set-up
        ahead has finished (imports done, model and data built): taking it then only names the slot, no CPU
        of a start, so a replacement in it can join the recovery generation itself (the controller's
        ``_take_prebuilt``). Never waits."""
        if self._standby is None or self._standby_setup is None:
            return False
        refs = [self._standby_probe, self._standby_setup]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(done) < len(refs):
            return False
        try:
            node = ray.get(self._standby_probe)
            ray.get(self._standby_setup)
        except Exception:  # noqa: BLE001 - its set-up ahead failed or it died: spawn decides as before
            return False
        return node is not None and node == self._bundle_node(index)

    def start_due_standby(self) -> None:
        """Start the next standby that a replacement which came up made due (:meth:`collect_ready`), on that
        slot's node; nothing when none is due. The controller calls it once the generation the replacement
        joined has completed a step: Ray's start of the process (about a CPU second, in the idle class where
        :meth:`_watch_start` applies, else at the raylet's nice) and the driver's actor creation then fall
        outside the recovery's rendezvous, state copy and first step (docs/perf/2026-11-28-drill-cost.md)."""
        index, self._standby_due = self._standby_due, None
        if index is not None:
            self._start_standby(index)

    def _take_standby(self, index: int) -> Any:
        """The standby process for slot ``index``, if one is on that slot's node. One still importing is
        taken too: it started earlier than a new process would, and a second process importing beside it
        would only slow both down."""
        if self._standby is None:
            return None
        done, _ = ray.wait([self._standby_probe], timeout=0)
        if done:
            try:
                node = ray.get(self._standby_probe)
            except Exception:  # noqa: BLE001 - it died (its node went): start another later
                self._drop_standby()
                return None
        else:  # still importing: it runs on the node of the bundle it was started in
            node = self._standby_node
        if node is None or node != self._bundle_node(index):
            return None
        actor, self._standby, self._standby_probe, self._standby_node = self._standby, None, None, None
        self._standby_setup = None
        # back to the training priority: from inside (once its actor exists and has the GIL) and, where it runs
        # on this node, from outside at once, imports still running or not (the bound on SCHED_IDLE's GIL
        # hazard: worker/import_priority.py)
        actor.wake.remote()
        if self._standby_file:
            put_back(self._standby_file)  # a mark left there is removed at shutdown
            self._marks = [*self._marks, self._standby_file]
        self._standby_file = None
        if self._standby_watch is not None:  # last: what it lowered before the preload (or is lowering now)
            self._standby_watch.put_back()
            self._standby_watch = None
        return actor

    def _forget_standby_files(self) -> None:
        for path in [self._standby_file, *self._marks]:
            if path:
                try:
                    os.unlink(path)
                except OSError:  # never written (another node, not lowered) or already gone
                    pass
        self._standby_file, self._marks = None, []

    def _drop_standby(self) -> None:
        if self._standby_watch is not None:
            self._standby_watch.close()
            self._standby_watch = None
        if self._standby is not None:
            try:
                ray.kill(self._standby, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._standby, self._standby_probe, self._standby_node, self._standby_setup = None, None, None, None
        if self._standby_file:  # its process is gone: so is the need for its file
            self._marks = [*self._marks, self._standby_file]
        self._standby_file = None

    def collect_ready(self, timeout: float = 0.0) -> list[Slot]:
        """Slots whose set-up finished since the last call (now READY). Failed set-ups become DEAD and are
        returned too, with ``info['error']`` set."""
        pending = {s.setup_ref: s for s in self.by_state(SlotState.STARTING)}
        if not pending:
            return []
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
        out = []
        for ref in done:
            slot = pending[ref]
            slot.setup_ref = None
            try:
                slot.info = ray.get(ref)
                slot.info["standby"] = slot.from_standby
                slot.info["reused"] = slot.reused
                slot.state = SlotState.READY
                if slot.incarnation > 1:  # a replacement is up: a process for the next one, once the run is
                    self._standby_due = slot.index  # back to speed (start_due_standby)
            except Exception as e:  # noqa: BLE001 - set-up error becomes a slot failure
                slot.info = {"error": describe_remote_error(e)}
                self.kill(slot)
            out.append(slot)
        return out

    def kill(self, slot: Slot) -> None:
        """Kill the slot's actor. A stopped (SIGSTOP) process may not answer Ray's kill RPC, so on this node
        the process is also sent SIGKILL by pid."""
        pid = slot.info.get("pid")
        if pid and slot.info.get("ip") == ray.util.get_node_ip_address():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if slot.actor is not None:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:  # already gone
                pass
        slot.actor, slot.setup_ref, slot.state, slot.rank, slot.has_state = None, None, SlotState.DEAD, None, False

    def process_gone(self, slot: Slot) -> bool:
        """True if the slot's worker process is known dead on this node (gone, or a zombie not yet reaped).
        Faster than Ray's actor-death notice; False when unknown (another node: Ray's notice decides)."""
        pid = slot.info.get("pid")
        if not pid or slot.info.get("ip") != ray.util.get_node_ip_address():
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return True
        return state in ("Z", "X")

    def by_state(self, *states: SlotState) -> list[Slot]:
        """The slots in any of ``states``, in slot order; from the state index (built on first use, kept by
        :class:`Slot` on every state change): O(slots found), not O(slots)."""
        index = self._state_index()
        return [self.slots[i] for i in sorted(i for st in states for i in index[st])]

    def _state_index(self) -> dict[SlotState, set[int]]:
        index = self.__dict__.get("_by_state")
        if index is None:
            index = {st: set() for st in SlotState}
            for slot in self.slots:
                index[slot.state].add(slot.index)
                object.__setattr__(slot, "_by_state", index)
            self.__dict__["_by_state"] = index
        return index

    def count(self, state: SlotState) -> int:
        """How many slots are in ``state``: O(1)."""
        return len(self._state_index()[state])

    def members(self) -> list[Slot]:
        """The current generation's members, in rank order: one sort of the indexed members."""
        slots = self.slots
        return sorted([slots[i] for i in self._state_index()[SlotState.MEMBER]], key=_rank)

    def shutdown(self) -> None:
        self._drop_standby()
        self._forget_standby_files()
        for slot in self.slots:
            if slot.actor is not None and slot.state in (SlotState.MEMBER, SlotState.READY):
                try:
                    ray.get(slot.actor.shutdown.remote(), timeout=10)
                except Exception:
                    pass
            self.kill(slot)
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        if self._reuse:  # this run's retired workers stay, with what the pool held and this run did not take,
            # bounded per node and key by what its CPUs hold (warm_pool.py); the rest goes
            POOL.release(self._pool_key, self._warm, self._pool_cpus())
            self._warm = []

    def _pool_cpus(self) -> dict[str, float] | None:
        """The CPUs of each alive node, which bound what the pool keeps there (None: unknown, the pool keeps
        this run's workers only)."""
        try:
            nodes = ray.nodes()
        except Exception:  # noqa: BLE001 - Ray going away
            return None
        return node_cpus(nodes)
