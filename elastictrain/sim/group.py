"""The worker group over simulated workers: the interface of
:class:`~elastictrain.controller.group.WorkerGroup` (spawn, set-up, kill, placement), with the simulated
world as its runtime. Slot ``i`` lives on node ``i // ranks_per_node``; a slot of a lost node is placed
again once its node is back."""

from __future__ import annotations

from elastictrain.controller.group import Slot, SlotState, WorkerGroup, describe_remote_error
from elastictrain.sim.world import SimWorld


class SimGroup(WorkerGroup):
    """``prebuilt_standby``: the group holds one standby with its set-up ahead done (``workers.standby`` on a
    machine where it is up before the next failure): the next replacement takes it
    (:meth:`WorkerGroup.standby_prebuilt` says so; its set-up still takes the world's ``setup_s``), and once
    that one is set up the next standby is there, prebuilt."""

    def __init__(self, world: SimWorld, slots: int, prebuilt_standby: bool = False) -> None:  # noqa: D107
        self.world = world
        self.rt = world
        self.slots = [Slot(i) for i in range(slots)]
        self._sim_standby = prebuilt_standby  # a prebuilt standby is there now
        self._sim_taken: set[int] = set()

    def standby_prebuilt(self, index: int) -> bool:
        return self._sim_standby and self.slots[index].incarnation > 0

    def spawn(self, index: int) -> Slot:
        slot = self.slots[index]
        if self.standby_prebuilt(index):
            self._sim_standby = False
            self._sim_taken.add(index)
        slot.actor = self.world.spawn(index)
        slot.setup_ref = slot.actor.setup.remote(index)
        slot.state, slot.has_state, slot.rank, slot.info = SlotState.STARTING, False, None, {}
        slot.incarnation += 1
        return slot

    def collect_ready(self, timeout: float = 0.0) -> list[Slot]:
        pending = {s.setup_ref: s for s in self.by_state(SlotState.STARTING)}
        if not pending:
            return []
        done, _ = self.world.wait(list(pending), num_returns=len(pending), timeout=timeout)
        out = []
        for ref in done:
            slot = pending[ref]
            slot.setup_ref = None
            try:
                slot.info, slot.state = self.world.get(ref), SlotState.READY
                slot.info["standby"] = slot.index in self._sim_taken
                if slot.index in self._sim_taken:  # it is up: the next standby is there (prebuilt)
                    self._sim_taken.discard(slot.index)
                    self._sim_standby = True
            except Exception as e:  # noqa: BLE001 - its node went while it set up
                slot.info = {"error": describe_remote_error(e)}
                self.kill(slot)
            out.append(slot)
        return out

    def kill(self, slot: Slot) -> None:
        if slot.actor is not None:
            self.world.kill(slot.actor)
        slot.actor, slot.setup_ref, slot.state, slot.rank, slot.has_state = None, None, SlotState.DEAD, None, False

    def process_gone(self, slot: Slot) -> bool:
        return False  # the run ref says so (Ray's notice); there is no process to look at

    def placed(self, slot: Slot) -> bool:
        return self.world.node_of(slot.index) not in self.world.dead_nodes

    def shortfall(self) -> str:
        return f"{len(self.world.dead_nodes)} simulated nodes are down"

    def replace_lost_placement(self, index: int) -> bool:
        return False

    def start_first_standby(self) -> None:
        pass

    def shutdown(self) -> None:
        for slot in self.slots:
            self.kill(slot)
