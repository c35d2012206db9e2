"""The worker group over simulated workers: the interface of
:class:`~elastictrain.controller.group.WorkerGroup` (spawn, set-up, kill, placement), with the simulated
world as its runtime. Slot ``i`` lives on node ``i // ranks_per_node``; a slot of a lost node is placed
again once its node is back."""

from __future__ import annotations

from elastictrain.controller.group import Slot, SlotState, WorkerGroup, describe_remote_error
from elastictrain.sim.world import SimWorld


class SimGroup(WorkerGroup):
    def __init__(self, world: SimWorld, slots: int) -> None:  # noqa: D107 - no placement groups to make
        self.world = world
        self.rt = world
        self.slots = [Slot(i) for i in range(slots)]

    def spawn(self, index: int) -> Slot:
        slot = self.slots[index]
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
